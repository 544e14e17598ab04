"""Bad fine-tuning input is caught before training, with a message naming the file and row or the config key.

Config time (Snakemake's dry run, no job starts): a missing ``sft_data.path`` (it once gave exit 0 and
trained on the old splits) and a template without ``{output}`` or with an unknown field. prepare-sft: a
data set too small for its split, with the counts. Encoding: an over-long example loses tokens from its
``truncation_field`` only (question and answer kept), counted, and the job log's warning names the file
and the lines.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, REPO, Workspace, env_with_venv

from snakellm.finetune import dataset as ds
from snakellm.tokenize import encoders

GPT2 = REPO / "resources" / "tokenizers" / "gpt2"


def _config(root: Path, **ft_examples) -> dict:
    for d in ("squad", "corpus", "tokenizers"):  # the config names the shipped tokenizer files (checked at config time)
        shutil.copytree(REPO / "resources" / d, root / "resources" / d)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["sft_data"] = {"q": {"path": "resources/squad/squad-dev-subset.json", "template": "Q: {question} A:"}}
    cfg["finetune"] = {
        "ft": {"run": "tiny", "data": "q", "method": "lora", "train": {"steps": 2}, "examples": ft_examples}
    }
    return cfg


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["sft_data"]["q"].update(path="data/gone.json"), "config key sft_data.q.path: data/gone.json: no"),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{input} A: {output} B"),
            "config key finetune.ft.examples.template: '{input} A: {output} B' must end with {output}",
        ),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{input} {answer} {output}"),
            "config key finetune.ft.examples.template: unknown field {answer}",
        ),
        (
            lambda c: c["sft_data"]["q"].update(template="Q: {question} ({topic}) A:"),
            "config key sft_data.q.template: unknown field {topic}",
        ),
    ],
)
@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_config_errors_before_any_job(workspace: Workspace, edit, message: str) -> None:
    cfg = _config(workspace.root)
    edit(cfg)
    workspace.write_config(cfg)
    out = workspace.run("-n", check=False)
    assert out.returncode != 0 and message in out.stdout + out.stderr, out.stderr[-2000:]


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_missing_sft_file_after_a_build_is_an_error(workspace: Workspace) -> None:
    """The data set's file removed after its splits were built: an error, not the old splits."""
    ws = workspace
    cfg = _config(ws.root)
    ws.write_config(cfg)
    ws.run("data/sft/q/stats.json")
    (ws.root / "resources" / "squad" / "squad-dev-subset.json").unlink()
    out = ws.run("-n", "data/sft/q/stats.json", check=False)
    assert out.returncode != 0
    assert "config key sft_data.q.path: resources/squad/squad-dev-subset.json: no such file" in out.stdout + out.stderr


def test_too_small_data_set_is_refused_with_the_counts(tmp_path: Path) -> None:
    src = tmp_path / "five.jsonl"
    src.write_text("".join(json.dumps({"input": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(5)))
    out = subprocess.run(
        [str(BIN / "snakellm"), "prepare-sft", str(src), str(tmp_path / "out"), "--format", "jsonl"],
        env=env_with_venv(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and not (tmp_path / "out" / "train.jsonl").exists()
    assert f"{src}: too few records: 5 used (5 usable of 5, 0 rejected) split 80,10,10 give train 5, " in out.stderr
    assert "validation 0, test 0" in out.stderr


def _tok():
    return encoders.load("gpt2-bpe", vocab_file=str(GPT2 / "vocab.json"), merges_file=str(GPT2 / "merges.txt"))


def test_over_long_context_keeps_question_and_answer(tmp_path: Path) -> None:
    tok = _tok()
    short = {"input": "x", "output": "Paris", "context": "France.", "question": "What is the capital of France?"}
    long = dict(short, context=" ".join(f"word{i}" for i in range(400)))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (short, long, short)))
    records = ds.read_jsonl(path)
    template = "Context: {context} Question: {question} Answer: {output}"
    enc = ds.Encoder(tok, 65, template, truncation_method="left", truncation_field="context")
    exs = enc.encode_all(records)
    alone = ds.Encoder(tok, 10_000, template, truncation_field="context").encode(records[1])
    cut = exs[1]
    assert len(cut.ids) == 65 and cut.answer == alone.answer  # the answer (+ EOD) whole
    text = tok.decode(cut.context)
    assert text.startswith("Context:") and text.endswith(" word399 Question: What is the capital of France? Answer:")
    assert "word0 " not in text  # the context lost its start (left)
    assert cut.truncated == len(alone.ids) - 65 and not exs[0].truncated
    assert enc.stats.context_truncated == 1 and enc.stats.tokens_dropped == cut.truncated
    assert enc.stats.answer_truncated == 0
    warning = ds.truncation_warning(path, exs, enc)
    assert warning is not None and f"{path}: 1 of 3 examples longer than 64 tokens" in warning
    assert "lines 2" in warning and "truncation_field 'context' from the left" in warning
    right = ds.Encoder(tok, 65, template, truncation_method="right", truncation_field="context").encode(records[1])
    assert tok.decode(right.context).startswith("Context: word0 word1") and right.answer == alone.answer
    assert tok.decode(right.context).endswith(" Question: What is the capital of France? Answer:")
