"""The workflow's Hugging Face and generation stages: the default target ends with runs/tiny/hf/ and
samples; each reruns only when its checkpoint or its own settings change; an HF directory imports
into a run that exports and samples like a trained one; bad input stops Snakemake before any job."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import Workspace, age
from hf_helpers import GPT2_DIR

pytestmark = pytest.mark.slow


def _jobs(ws: Workspace, *targets: str) -> dict[str, int]:
    """Jobs a dry run would start, by rule."""
    out = ws.run("-n", *targets, "--quiet", "rules")
    jobs = {}
    for line in (out.stdout + out.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job", "all"):
            jobs[parts[0]] = int(parts[1])
    # the report stage redraws its figures of whatever changed: not this stage's business here
    return {k: v for k, v in jobs.items() if not k.startswith(("report", "dag"))}


@pytest.fixture
def copy_of_default(default_workflow: Workspace, tmp_path: Path) -> Workspace:
    """A private copy (mtimes and Snakemake's records kept) that a test may change."""
    root = tmp_path / "ws"
    shutil.copytree(default_workflow.root, root, symlinks=True)
    return Workspace(root)


def test_default_workflow_ends_with_hf_and_samples(default_workflow: Workspace):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ws = default_workflow
    hf_dir = ws.path("runs/tiny/hf")
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    samples = [json.loads(line) for line in ws.path("runs/tiny/samples.jsonl").read_text().splitlines()]
    prompts = yaml.safe_load((Path(__file__).parent.parent / "config" / "schema.yaml").read_text())
    default_prompts = prompts["properties"]["generate"]["properties"]["prompts"]["default"]
    assert [s["prompt"] for s in samples] == default_prompts
    assert all(s["tokens"] > 0 and s["completion"] for s in samples)
    assert "## 1" in ws.path("runs/tiny/samples.md").read_text()
    # transformers loads it and computes what our checkpoint computes
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.tensor([tok("The history of the town")["input_ids"]])
    from snakellm.models.loading import load

    ours = load(ws.path("runs/tiny"))
    with torch.no_grad():
        a = ours.model(ids, torch.arange(ids.shape[1])[None], None)[..., : hf.config.vocab_size]
        b = hf(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    # its own targets (other tests build more stages in the shared workspace, which redraws the DAG)
    assert ws.nothing_to_do("runs/tiny/hf", "runs/tiny/samples.jsonl")


def test_reruns_only_on_checkpoint_or_own_settings(copy_of_default: Workspace):
    ws = copy_of_default
    assert _jobs(ws) == {}
    cfg = ws.read_config()
    cfg["generate"] = {"max_new_tokens": 12}
    ws.write_config(cfg)
    assert _jobs(ws) == {"generate": 1}
    cfg["export_hf"] = {"max_shard_size": "1MB"}
    ws.write_config(cfg)
    assert _jobs(ws) == {"generate": 1, "export_hf": 1, "evaluate_lm": 1}  # lm-eval reads the export
    cfg.pop("generate")
    cfg.pop("export_hf")
    cfg["lm_eval"] = {"suites": {"default": {"limit": 5}}}  # a suite's settings: that suite only
    ws.write_config(cfg)
    assert _jobs(ws) == {"evaluate_lm": 1}
    cfg.pop("lm_eval")
    ws.write_config(cfg)
    assert _jobs(ws) == {}
    # a new checkpoint (the run's summary is rewritten after it) reruns the exports and samples, nothing else
    age(ws.root, 60, "runs")
    summary = ws.path("runs/tiny/train_summary.json")
    summary.write_text(summary.read_text() + "\n")  # new content: Snakemake ignores a bare touch of small files
    assert _jobs(ws) == {"generate": 1, "export_hf": 1, "export_nemo": 1, "evaluate_lm": 1}


def test_import_hf_rule_then_export_and_samples(workspace: Workspace):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, GPT2Config

    ws = workspace
    src = ws.path("hub/gpt2-small-random")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, activation_function="gelu")
    ).eval()
    hf.save_pretrained(src)
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_DIR / f, src / f)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    shutil.copytree(Path(__file__).parent.parent / "resources" / "corpus", ws.path("resources/corpus"))
    ws.write_config(
        {
            "sources": {
                "botchan": {
                    "kind": "local",
                    "path": "resources/corpus/botchan/*.jsonl",
                    "format": "jsonl",
                    "shards_per_chunk": 1,
                }
            },
            "tokenize": {"tokenizers": []},
            "import_hf": {"gpt2r": {"hf_dir": "hub/gpt2-small-random"}},
            "generate": {"max_new_tokens": 8, "prompts": ["Hello"]},
        }
    )
    ws.run("runs/gpt2r/hf", "runs/gpt2r/samples.jsonl", "runs/gpt2r/gpt2r.nemo")
    import tarfile

    with tarfile.open(ws.path("runs/gpt2r/gpt2r.nemo")) as tar:  # the .nemo export chained to the import
        names = tar.getnames()
    assert "./model_config.yaml" in names and any(n.startswith("./model_weights/") for n in names)
    summary = json.loads(ws.path("runs/gpt2r/import_summary.json").read_text())
    assert summary["arch"]["style"] == "gpt2" and summary["padded_vocab_size"] == 50304
    back = AutoModelForCausalLM.from_pretrained(ws.path("runs/gpt2r/hf")).state_dict()
    orig = hf.state_dict()
    assert back.keys() == orig.keys() and all(torch.equal(back[k], orig[k]) for k in orig)
    assert json.loads(ws.path("runs/gpt2r/samples.jsonl").read_text().splitlines()[0])["tokens"] == 8
    targets = ("runs/gpt2r/hf", "runs/gpt2r/samples.jsonl", "runs/gpt2r/gpt2r.nemo")
    assert _jobs(ws, *targets) == {}
    # full SFT of the imported model, evaluated beside it (its tokenizer is the import's own: no blend.json)
    shutil.copytree(Path(__file__).parent.parent / "resources" / "squad", ws.path("resources/squad"))
    cfg = ws.read_config()
    cfg["sft_data"] = {
        "q": {"path": "resources/squad/squad-dev-subset.json", "template": "Question: {question} Answer:", "limit": 48}
    }
    cfg["finetune"] = {
        "gpt2r-full": {
            "run": "gpt2r",
            "data": "q",
            "method": "full",
            "examples": {"truncation_method": "left"},
            "train": {"steps": 6, "micro_batch_size": 4, "global_batch_size": 4, "lr": 1.0e-3, "eval_interval": 3},
            "evaluate": {"tokens_to_generate": 8},
        }
    }
    ws.write_config(cfg)
    ev = "runs/gpt2r/eval/gpt2r-full"
    ws.run(f"{ev}/comparison.json")
    ft = json.loads(ws.path("runs/gpt2r/finetune/gpt2r-full/finetune_summary.json").read_text())
    assert ft["method"] == "full" and ft["trainable_parameters"] == ft["total_parameters"]
    assert ft["final_loss"] < ft["first_loss"]
    comparison = json.loads(ws.path(f"{ev}/comparison.json").read_text())
    base_m, tuned_m = (json.loads(ws.path(f"{comparison[w]}/metrics.json").read_text()) for w in ("base", "tuned"))
    assert base_m["examples"] == tuned_m["examples"] > 0
    assert tuned_m["test_loss"] < base_m["test_loss"]
    # the HF weights change -> the import and everything after it rerun
    age(ws.root, 60, "runs")
    with open(src / "model.safetensors", "ab") as fh:  # an edited weights file (new content, not just mtime)
        fh.write(b" ")
    assert _jobs(ws, *targets) == {"import_hf": 1, "export_hf": 1, "generate": 1, "export_nemo": 1}


def test_bad_input_is_an_error_before_any_job(workspace: Workspace):
    ws = workspace
    shutil.copytree(Path(__file__).parent.parent / "resources" / "corpus", ws.path("resources/corpus"))
    base = {
        "sources": {
            "botchan": {
                "kind": "local",
                "path": "resources/corpus/botchan/*.jsonl",
                "format": "jsonl",
                "shards_per_chunk": 1,
            }
        },
        "tokenizers": {
            "gpt2": {
                "kind": "gpt2-bpe",
                "vocab_file": str(GPT2_DIR / "vocab.json"),
                "merges_file": str(GPT2_DIR / "merges.txt"),
            }
        },
    }
    ws.write_config({**base, "import_hf": {"x": {"hf_dir": "no/such/dir"}}})
    out = ws.run("-n", check=False)
    assert out.returncode != 0 and "import_hf.x.hf_dir" in out.stdout + out.stderr
    run = {
        "tokenizer": "gpt2",
        "model": {"preset": "tiny", "position_embedding": "rope"},
        "train": {"steps": 1, "micro_batch_size": 1, "global_batch_size": 1},
    }
    ws.write_config({**base, "runs": {"odd": run}})
    out = ws.run("-n", check=False)
    assert out.returncode != 0 and "runs.odd.model: Hugging Face export" in out.stdout + out.stderr
    # a missing checkpoint: the step says so before loading anything
    import subprocess
    import sys

    from conftest import env_with_venv

    for step in ("export-hf", "generate"):
        extra = ["--prompt", "x"] if step == "generate" else [str(ws.path("out"))]
        p = subprocess.run(
            [sys.executable, "-m", "snakellm.cli", step, str(ws.path("runs/none")), *extra],
            capture_output=True,
            text=True,
            env=env_with_venv(),
            timeout=120,
        )
        assert p.returncode == 2 and "runs/none" in p.stderr, p.stderr
