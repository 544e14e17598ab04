"""The evaluate_lm stage: lm-evaluation-harness on the default run's Hugging Face export, offline.

The shipped suite is built deterministically from resources/ (held-out Wikipedia articles the default
config never trains on, and the SQuAD subset); the default workflow ends with runs/tiny/lm_eval/default.json,
lm-eval's own results and samples with real values; a task that would need the network fails at once
(the offline switches are set); and the loglikelihood tasks give the same scores through ``snakellm serve``
(lm-eval's ``local-completions`` model) as through lm-eval's ``hf`` model on the export.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from conftest import REPO, env_with_venv

from snakellm.eval import lm_tasks

DEFAULT_LIMIT = 40  # config/schema.yaml: lm_eval.suites.default.limit
LL_TASKS = ("snakellm_wikitext", "snakellm_lambada", "snakellm_cont4")


def _snakellm(*args: str, cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakellm.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env or env_with_venv(), timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm-tasks")
    lm_tasks.build_default_suite(
        root / "tasks",
        wikipedia=str(REPO / lm_tasks.WIKIPEDIA),
        squad=str(REPO / lm_tasks.SQUAD),
    )
    return root / "tasks"


@pytest.mark.slow  # reads the default-workflow build: the slow tier (fast-tier budget)
def test_the_shipped_suite_is_deterministic_and_in_lm_evals_formats(built, tmp_path):
    again = tmp_path / "again"
    lm_tasks.build_default_suite(again, wikipedia=str(REPO / lm_tasks.WIKIPEDIA), squad=str(REPO / lm_tasks.SQUAD))
    for f in sorted(built.glob("*.jsonl")):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    rows = {t: [json.loads(x) for x in (built / f"{t}.test.jsonl").read_text().splitlines()] for t in lm_tasks.TASKS}
    assert {t: len(r) for t, r in rows.items()} == lm_tasks.SIZES
    assert all(len(d["page"]) >= lm_tasks.DOC_CHARS // 2 for d in rows["snakellm_wikitext"])
    for d in rows["snakellm_lambada"]:  # the target is the passage's last word, a word of letters
        assert d["text"].split(" ")[-1].isalpha() and len(d["text"].split()) >= 25
    for d in rows["snakellm_cont4"]:
        assert len(d["endings"]) == 4 == len(set(d["endings"])) and 0 <= d["label"] < 4
    assert sorted({d["label"] for d in rows["snakellm_cont4"]}) == [0, 1, 2, 3]
    for d in rows["snakellm_squad"]:
        assert d["answers"] and all(a in d["context"] for a in d["answers"])
    # the few-shot split never repeats a test document
    for t in ("snakellm_lambada", "snakellm_cont4", "snakellm_squad"):
        train = (built / f"{t}.train.jsonl").read_text().splitlines()
        assert len(train) == lm_tasks.FEWSHOT and not set(train) & set(
            (built / f"{t}.test.jsonl").read_text().splitlines()
        )


@pytest.mark.slow  # ~4 s (the suite built): the slow tier (fast-tier budget)
def test_the_wikipedia_text_is_held_out_from_the_default_corpus(built):
    """Not one passage of the perplexity, cloze or continuation tasks is in the text the tiny run trains on."""
    corpus = []
    for f in sorted((REPO / "resources/corpus").rglob("*.jsonl*")):
        raw = f.read_bytes()
        text = zstandard.ZstdDecompressor().decompressobj().decompress(raw) if f.suffix == ".zst" else raw
        corpus += [json.loads(x)["text"] for x in text.decode().splitlines() if x.strip()]
    joined = " ".join(" ".join(t.split()) for t in corpus)
    probes = [json.loads(x)["page"][:80] for x in (built / "snakellm_wikitext.test.jsonl").read_text().splitlines()]
    probes += [json.loads(x)["text"][-80:] for x in (built / "snakellm_lambada.test.jsonl").read_text().splitlines()]
    assert len(probes) == 360 and not [p for p in probes if p in joined]


@pytest.mark.slow  # lm-eval's TaskManager indexes its task registry: ~5 s, the fast tier's 90 s has no room
def test_lm_eval_loads_the_tasks_from_include_path(built):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(built), include_defaults=False)
    assert set(lm_tasks.TASKS) <= set(tm.all_tasks)


def test_evaluate_lm_help_lists_the_suite_settings():
    from snakellm.steps import evaluate_lm

    text = " ".join(evaluate_lm.build_parser().format_help().split())
    for flag in ("--tasks", "--num-fewshot", "--limit", "--batch-size", "--bootstrap-iters", "--include-path"):
        assert flag in text
    # argparse may wrap the long default inside a word
    assert "(default:snakellm_wikitext,snakellm_lambada,snakellm_cont4,snakellm_squad)" in "".join(text.split())
    assert "(default: 16)" in text


def _result(ws) -> dict:
    return json.loads(ws.path("runs/tiny/lm_eval/default.json").read_text())


@pytest.mark.slow
def test_default_workflow_ends_with_lm_eval_results(default_workflow):
    ws = default_workflow
    r = _result(ws)
    assert set(r["results"]) == set(lm_tasks.TASKS)
    for task in lm_tasks.TASKS:  # lm-eval's own samples, as many as the limit
        assert r["n-samples"][task]["effective"] == DEFAULT_LIMIT
        assert len(r["samples"][task]) == DEFAULT_LIMIT
    wt = r["results"]["snakellm_wikitext"]
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        assert math.isfinite(wt[metric]) and wt[metric] > 1, (metric, wt)
    # bits per byte is log2 of the byte perplexity (lm-eval's wikitext metrics)
    assert wt["bits_per_byte,none"] == pytest.approx(math.log2(wt["byte_perplexity,none"]), rel=1e-9)
    lam = r["results"]["snakellm_lambada"]
    assert math.isfinite(lam["perplexity,none"]) and lam["perplexity,none"] > 1
    for task, metric in (
        ("snakellm_lambada", "acc,none"),
        ("snakellm_cont4", "acc,none"),
        ("snakellm_cont4", "acc_norm,none"),
        ("snakellm_squad", "exact_match,strip"),
    ):
        assert 0.0 <= r["results"][task][metric] <= 1.0
    # real model outputs: log-likelihoods below zero, four scored choices, generated answers
    assert all(s["filtered_resps"][0][0] < 0 for s in r["samples"]["snakellm_lambada"])
    assert all(len(s["filtered_resps"]) == 4 for s in r["samples"]["snakellm_cont4"])
    # generated answers: strings (the default tokenizer keeps newlines since issue 42, and the tiny model's first
    # token after "Answer:" may be one, where the task's `until` stops: an empty answer is a real answer here)
    assert all(isinstance(s["filtered_resps"][0], str) for s in r["samples"]["snakellm_squad"])
    # offline, on the run's export
    assert r["snakellm"]["offline_env"]["HF_DATASETS_OFFLINE"] == "1"
    assert r["snakellm"]["model_dir"] == "runs/tiny/hf" and r["config"]["model"] == "hf"
    log = ws.path("logs/evaluate_lm/tiny/default.log").read_text()
    assert "snakellm_cont4 acc " in log and "wrote runs/tiny/lm_eval/default.json" in log


@pytest.mark.slow
def test_a_task_that_needs_the_network_fails_offline(default_workflow, tmp_path):
    """lm-eval's own lambada_openai downloads from the Hub; offline, with an empty cache, it fails at once."""
    env = {**env_with_venv(), "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    p = _snakellm(
        "evaluate-lm",
        str(default_workflow.path("runs/tiny/hf")),
        "--out",
        str(tmp_path / "out.json"),
        "--tasks",
        "lambada_openai",
        "--limit",
        "2",
        "--device",
        "cpu",
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert p.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "offline" in p.stderr.lower(), p.stderr[-3000:]


@pytest.mark.slow
def test_loglikelihood_scores_through_snakellm_serve_equal_the_hf_model(default_workflow, tmp_path):
    """local-completions against `snakellm serve` gives the hf model's scores on the three loglikelihood tasks:
    per document log-likelihoods within 1e-4 absolute or 1e-6 relative, every aggregate within 1e-4 relative."""
    from serve_helpers import ServerProcess

    ws = default_workflow
    limit = "8"
    common = ["--include-path", str(ws.path("data/lm_eval/tasks")), "--tasks", ",".join(LL_TASKS), "--limit", limit]
    hf = str(ws.path("runs/tiny/hf"))
    # lm-eval's API models keep 2 of max_length back (a generated token; the rolling window's context token):
    # local-completions at 128 (the tiny model's positions) scores the same windows as hf at 126
    ref = _snakellm(
        "evaluate-lm", hf, "--out", str(tmp_path / "hf.json"), "--device", "cpu", "--max-length", "126", *common,
        cwd=ws.root,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    # lm-eval's own prints ("bootstrapping for stddev: perplexity") go to the job's log, not the terminal
    assert ref.stdout == "" and "bootstrapping for stddev" in ref.stderr
    server = ServerProcess(ws.path("runs/tiny"), "--quiet", "--model-name", "tiny", cwd=tmp_path)
    try:
        url = f"{server.url}/v1/completions"
        ours = _snakellm(
            "evaluate-lm", hf, "--out", str(tmp_path / "served.json"), "--base-url", url, "--max-length", "128",
            "--batch-size", "1", *common, cwd=ws.root,
        )  # fmt: skip
        assert ours.returncode == 0, ours.stderr[-3000:] + "".join(server.log[-30:])
    finally:
        server.stop()
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("served", "hf"))
    assert a["config"]["model"] == "local-completions" and b["config"]["model"] == "hf"
    for task in LL_TASKS:
        assert len(a["samples"][task]) == len(b["samples"][task]) == int(limit)
        for sa, sb in zip(a["samples"][task], b["samples"][task], strict=True):
            lla = [float(x[0]) if isinstance(x, list) else float(x) for x in sa["filtered_resps"]]
            llb = [float(x[0]) if isinstance(x, list) else float(x) for x in sb["filtered_resps"]]
            # a wikitext document's log-likelihood sums ~1,000 float32 token log-probabilities: 1e-6 relative
            assert lla == pytest.approx(llb, rel=1e-6, abs=1e-4), (task, sa["doc_id"])
        for key, value in b["results"][task].items():
            if isinstance(value, float):
                assert a["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
