"""Fine-tuning learns, end to end on CPU, from the default workflow's pretrained tiny model.

For each method (LoRA, full SFT, p-tuning) one real ``snakellm finetune`` run on 8 SQuAD
questions (``Question: ... Answer:``; the tiny model's 128 positions hold no SQuAD paragraph):
the answer-only training loss falls, greedy generation reproduces the trained answers
(NeMo's raw exact_string_match on the trained subset), and on held-out questions the
validation loss ends below the base model's. Then an exact resume after SIGKILL, and the
whole stage through Snakemake (prepare_sft -> finetune -> export_peft -> evaluate base + tuned).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import BIN, REPO, Workspace, env_with_venv

pytestmark = pytest.mark.slow

SQUAD = REPO / "resources" / "squad" / "squad-dev-subset.json"
BASE = ["--base", "runs/tiny", "--threads", "2", "--no-progress"]
# memorise 8 questions (constant lr, the last checkpoint): the path works end to end
MEMORISE_STEPS = {"lora": 200, "full": 80, "ptuning": 80}
# the shipped example (tiny-counts): the least exact match its tuned model must reach (the base: 0)
EXAMPLE_TUNED_EM = 0.7
MEMORISE = [
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "8",
    "--lr-decay-style",
    "constant",
    "--eval-interval",
    "20",
    "--select",
    "last",
]
# learn from 64 questions, validation on 16 others every 5 steps, the best checkpoint kept
GENERALISE = ["--steps", "30", "--micro-batch-size", "16", "--global-batch-size", "16", "--eval-interval", "5"]
METHOD_ARGS = {
    # the final LayerNorm trains beside the adapters (PEFT's modules_to_save): see test_method_learns
    "lora": [
        "--lora-rank",
        "16",
        "--lora-targets",
        "linear_qkv,linear_proj,linear_fc1,linear_fc2",
        "--lora-modules-to-save",
        "final_layernorm",
        "--lr",
        "1e-2",
    ],
    "full": ["--lr", "3e-3"],
    "ptuning": ["--virtual-tokens", "8", "--prompt-encoder", "mlp", "--prompt-encoder-hidden", "128", "--lr", "1e-2"],
}


def _run(*args: str, cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = env_with_venv()
    env["OMP_NUM_THREADS"] = "2"
    proc = subprocess.run([str(BIN / "snakellm"), *args], cwd=cwd, env=env, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakellm {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _write(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture(scope="module")
def sft(default_workflow: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SQuAD questions (``Question: ... Answer:``) split three ways, then two data sets inside the default
    workflow's directory: q8 (8 to memorise, 16 held out) and q64 (64 to learn from, 16 held out).

    Only questions whose answer the 2k SentencePiece tokenizer spells without <unk> (its embedding never
    trained in pretraining: no adapter can make the tied output layer predict it)."""
    import sentencepiece as spm

    root = default_workflow.root
    d = tmp_path_factory.mktemp("sft")
    _run(
        "prepare-sft",
        str(SQUAD),
        str(d / "all"),
        "--template",
        "Question: {question} Answer:",
        "--split",
        "1,1,1",
        cwd=root,
    )
    sp = spm.SentencePieceProcessor(model_file=str(root / "tokenizers" / "spm2k" / "tokenizer.model"))

    def spelled(r: dict) -> bool:
        return sp.decode(sp.encode(r["output"])) == r["output"] and sp.unk_id() not in sp.encode(r["input"])

    rows = {
        s: [r for r in map(json.loads, (d / "all" / f"{s}.jsonl").read_text().splitlines()) if spelled(r)]
        for s in ("train", "validation")
    }
    _write(d / "q8" / "train.jsonl", rows["train"][:8])
    _write(d / "q64" / "train.jsonl", rows["train"][8:72])
    _write(d / "q8" / "validation.jsonl", rows["validation"][:16])
    _write(d / "q64" / "validation.jsonl", rows["validation"][:16])
    return d


def _evaluate(root: Path, test: Path, out: Path, *extra: str) -> dict:
    _run(
        "evaluate",
        "--test",
        str(test),
        "--out-dir",
        str(out),
        # room for the longest memorised answer: with the default tokenizer's byte fallback a character
        # outside its vocabulary (e.g. "⊆") takes 3 tokens, and "P ⊆ NP ⊆ PP ⊆ PSPACE" needs 19
        "--tokens-to-generate",
        "32",
        *BASE[:4],
        *extra,
        cwd=root,
    )
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def base_scores(default_workflow: Workspace, sft: Path) -> dict:
    root = default_workflow.root
    return {
        "train": _evaluate(root, sft / "q8" / "train.jsonl", sft / "base-train"),
        "validation": _evaluate(root, sft / "q8" / "validation.jsonl", sft / "base-valid"),
    }


def _finetune(root: Path, data: Path, out: Path, method: str, *args: str) -> dict:
    _run(
        "finetune",
        *BASE,
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--method",
        method,
        *args,
        *METHOD_ARGS[method],
        cwd=root,
    )
    summary = json.loads((out / "finetune_summary.json").read_text())
    summary["records"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary


def _artifact(method: str, out: Path) -> list[str]:
    return {
        "lora": ["--adapter", str(out / "adapter")],
        "ptuning": ["--prompt", str(out / "prompt")],
        "full": ["--base", str(out / "model")],
    }[method]


@pytest.mark.parametrize("kernel,name", [("flex", "FlexAttention"), ("varlen", "flash variable-length attention")])
def test_gpu_packed_attention_is_refused_on_the_cpu(default_workflow: Workspace, sft: Path, kernel: str,
                                                    name: str) -> None:  # fmt: skip
    """FlexAttention and flash varlen attention have no backward pass on the CPU: the job stops before its first
    step, naming the setting."""
    root = default_workflow.root
    out = sft / f"{kernel}-cpu"
    args = ["--data-dir", str(sft / "q8"), "--out-dir", str(out), "--method", "lora", "--steps", "2"]
    proc = _run("finetune", *BASE, *args, "--packing", "--packed-attention", kernel, *METHOD_ARGS["lora"], cwd=root,
                check=False)  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"--packed-attention {kernel} (examples.packed_attention): {name} has no backward pass on the CPU; "
        "use dense" in proc.stderr
    ), proc.stderr[-2000:]
    assert not (out / "finetune_summary.json").exists()


@pytest.mark.parametrize("method", ["lora", "full", "ptuning"])
def test_method_learns(default_workflow: Workspace, sft: Path, base_scores: dict, method: str) -> None:
    root = default_workflow.root
    # 1. memorise 8 questions: answer-only loss down, greedy answers exact
    out = sft / f"mem-{method}"
    steps = MEMORISE_STEPS[method]
    mem = _finetune(root, sft / "q8", out, method, "--steps", str(steps), *MEMORISE)
    recs = [r for r in mem["records"] if "loss" in r]
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-5:]) / 5
    assert len(recs) == steps and mem["steps_run"] == steps and mem["chosen_iteration"] == steps
    trained = _evaluate(root, sft / "q8" / "train.jsonl", sft / f"{method}-train", *_artifact(method, out))
    print(
        method, "memorise", {"first_loss": first, "last_loss": last, "trained": trained, "base": base_scores["train"]}
    )
    assert base_scores["train"]["test_exact_string_match"] == 0.0
    if method != "ptuning":  # LoRA's B and full SFT start from the base model exactly
        assert first == pytest.approx(base_scores["train"]["test_loss"], rel=1e-3)
    if method == "full":
        assert last < 0.1 * first
    if method != "ptuning":
        assert trained["test_exact_string_match"] >= 0.9 and trained["squad_exact_match"] >= 0.9
    if method == "lora":
        # with the tied embedding E and the final LayerNorm frozen, every logit is E @ LN(x) and bounded
        # (|logit| <= |g * e_t| * sqrt(h) ~ 6 on this 300-step model): adapters alone reach a floor near
        # 2.86 nats per token and exact match 0 (measured: r=16/alpha=16 at lr 1e-2, r=32/alpha=64 at 5e-3).
        # Training the final LayerNorm beside them (2 x 64 numbers) lifts the bound: 6.74 -> 0.47 in 200 steps.
        assert last < 0.15 * first
    if method == "ptuning":
        # p-tuning moves only the first 8 input embeddings of a frozen model, and meets the same bound: it
        # learns slowly and reproduces no answer on this model. Measured 6.79 -> 6.43 in 80 steps with the old
        # spm2k; with byte fallback (the default since the data-stage round 2) 6.84 -> 6.66, a plateau reached in
        # ~30 steps: the bound moved with the base model, not the recipe (held-out loss below the base: part 2)
        assert last < 0.98 * first
    preds = [json.loads(line) for line in (sft / f"{method}-train" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 8 and all(set(p) >= {"input", "pred", "label", "answers"} for p in preds)

    # 2. learn from 64 questions: held-out validation loss of the kept (best) checkpoint below the base model's
    out = sft / f"gen-{method}"
    gen = _finetune(root, sft / "q64", out, method, *GENERALISE)
    held = _evaluate(root, sft / "q8" / "validation.jsonl", sft / f"{method}-valid", *_artifact(method, out))
    print(
        method,
        "generalise",
        {"best": gen["best"], "val_losses": gen["val_losses"], "held_out": held, "base": base_scores["validation"]},
    )
    base_val = base_scores["validation"]["test_loss"]
    assert gen["best"]["val_loss"] < base_val and gen["chosen_iteration"] == gen["best"]["iteration"]
    assert held["test_loss"] == pytest.approx(gen["best"]["val_loss"], rel=1e-3)
    kept = {p.name for p in (out / "checkpoints").glob("iter_*")}
    assert f"iter_{gen['best']['iteration']:07d}" in kept


def _losses(path: Path) -> dict[int, tuple]:
    return {
        r["step"]: (r["loss"], r.get("val_loss"), r["grad_norm"])
        for r in map(json.loads, path.read_text().splitlines())
    }


def test_exact_resume_after_sigkill(default_workflow: Workspace, sft: Path) -> None:
    """A LoRA run SIGKILLed after a checkpoint resumes bit for bit: the same losses as an uninterrupted run."""
    root = default_workflow.root
    args = [
        "--base",
        "runs/tiny",
        "--data-dir",
        str(sft / "q8"),
        "--method",
        "lora",
        "--lora-rank",
        "4",
        "--lora-dropout",
        "0.1",
        "--lora-targets",
        "linear_qkv,linear_fc2",
        "--steps",
        "12",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--lr",
        "1e-2",
        "--eval-interval",
        "3",
        "--keep-last",
        "2",
        "--threads",
        "2",
        "--no-progress",
    ]
    _run("finetune", *args, "--out-dir", str(sft / "whole"), cwd=root)
    env = env_with_venv()
    env["OMP_NUM_THREADS"] = "2"
    killed = sft / "killed"
    proc = subprocess.Popen(
        [str(BIN / "snakellm"), "finetune", *args, "--out-dir", str(killed)],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    tracker = killed / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if tracker.is_file() and int(tracker.read_text()) >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "finetune_summary.json").exists()
    resumed = _run("finetune", *args, "--out-dir", str(killed), cwd=root)
    assert "resumed from" in resumed.stderr
    assert _losses(killed / "metrics.jsonl") == _losses(sft / "whole" / "metrics.jsonl")
    # the same tensors bit for bit (the header's metadata order is a Rust HashMap's: not compared as bytes)
    import torch
    from safetensors import safe_open

    files = [d / "adapter" / "adapter.safetensors" for d in (killed, sft / "whole")]
    with safe_open(str(files[0]), "pt") as a, safe_open(str(files[1]), "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert (
                x.dtype == y.dtype
                and x.shape == y.shape
                and x.view(-1).view(torch.uint8).equal(y.view(-1).view(torch.uint8))
            ), k
    best = json.loads((killed / "finetune_summary.json").read_text())["best"]
    kept = sorted(p.name for p in (killed / "checkpoints").glob("iter_*"))
    assert f"iter_{best['iteration']:07d}" in kept and "iter_0000012" in kept


@pytest.fixture(scope="module")
def three_methods(default_workflow: Workspace) -> Workspace:
    """The example's SQuAD fine-tune (LoRA) beside a full one and a p-tuning one on the same data and evaluation
    settings, built through Snakemake (a shared fixture: three fine-tunes and four evaluations, ~50 s alone,
    twice that beside CI's other worker)."""
    root = default_workflow.root
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    extra = yaml.safe_load((REPO / "config" / "examples" / "tiny-squad-finetune.yaml").read_text())
    cfg["sft_data"] = {"squad-questions": extra["sft_data"]["squad-questions"]}
    cfg["finetune"] = {"tiny-lora": extra["finetune"]["tiny-lora"]}
    cfg["finetune"]["tiny-lora"]["train"]["steps"] = 20
    cfg["finetune"]["tiny-lora"]["examples"]["packing"] = True  # the rule's flag reaches the packed batches
    small = {"steps": 4, "micro_batch_size": 8, "global_batch_size": 8, "eval_interval": 2}
    for name, method in (("tiny-full", "full"), ("tiny-pt", "ptuning")):
        cfg["finetune"][name] = {
            "run": "tiny",
            "data": "squad-questions",
            "method": method,
            "ptuning": {"virtual_tokens": 4, "hidden": 32},
            "examples": dict(extra["finetune"]["tiny-lora"]["examples"], packing=False),
            "train": small,
            "evaluate": extra["finetune"]["tiny-lora"]["evaluate"],
        }
    ws = Workspace(root)
    ws.config_path = root / "config-finetune.yaml"
    ws.write_config(cfg)
    before = ws.snapshot("runs/tiny/checkpoints")
    ws.run(timeout=1800)
    assert not ws.changed(before, "runs/tiny/checkpoints")  # the pretrained run is only read
    return ws


def test_workflow_base_and_tuned(three_methods: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_sft -> finetune -> exports -> evaluate (base once, each tuned) -> comparison through Snakemake:
    one base evaluation serves all three methods; every method's export loads with transformers / peft."""
    ws = three_methods
    root = ws.root
    ev = root / "runs" / "tiny" / "eval" / "tiny-lora"
    base_dirs = list((root / "runs" / "tiny" / "eval" / "base" / "squad-questions").iterdir())
    assert len(base_dirs) == 1  # one base evaluation per run, data set and evaluation settings
    base, tuned = (json.loads((d / "metrics.json").read_text()) for d in (base_dirs[0], ev / "tuned"))
    for m in (base, tuned):
        assert m["examples"] == 16 and set(m) >= {
            "test_exact_string_match",
            "squad_exact_match",
            "squad_f1",
            "test_loss",
        }
    assert tuned["test_loss"] < base["test_loss"]
    preds = [json.loads(line) for line in (ev / "tuned" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 16 and all(set(p) >= {"input", "pred", "label"} for p in preds)
    # NeMo's predictions file beside ours: exactly its three fields, the same rows
    nemo = (ev / "tuned" / "predictions_test_dataloader0_inputs_preds_labels.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in nemo] == [{k: p[k] for k in ("input", "pred", "label")} for p in preds]
    comparison = json.loads((ev / "comparison.json").read_text())
    rows = {r["metric"]: r for r in comparison["metrics"]}
    assert rows["test_loss"]["base"] == base["test_loss"] and rows["test_loss"]["tuned"] == tuned["test_loss"]
    assert rows["test_loss"]["difference"] == pytest.approx(tuned["test_loss"] - base["test_loss"])
    assert comparison["base"] == str(base_dirs[0].relative_to(root))
    assert "| test_exact_string_match |" in (ev / "comparison.md").read_text()
    summary = json.loads((root / "runs" / "tiny" / "finetune" / "tiny-lora" / "finetune_summary.json").read_text())
    assert summary["train_examples"] == 16 and 1 <= summary["sequences"] < 16  # packed: several per row
    assert summary["method_config"]["modules_to_save"] == ["final_layernorm"]
    _check_exports(root, monkeypatch)
    out = ws.run("-n")
    assert "Nothing to be done" in out.stdout + out.stderr


def _check_exports(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method's export: PEFT adapters (LoRA, p-tuning) name and load onto runs/tiny/hf; full SFT: hf/, .nemo."""
    import tarfile

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    ft = root / "runs" / "tiny" / "finetune"
    monkeypatch.chdir(root)  # base_model_name_or_path is relative to the workflow directory
    tokens = torch.tensor([[5, 17, 42, 99, 7]])
    base = AutoModelForCausalLM.from_pretrained("runs/tiny/hf").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
    for name, peft_type in (("tiny-lora", "LORA"), ("tiny-pt", "PROMPT_TUNING")):
        conf = json.loads((ft / name / "hf_peft" / "adapter_config.json").read_text())
        assert conf["peft_type"] == peft_type and conf["base_model_name_or_path"] == "runs/tiny/hf"
        model = AutoPeftModelForCausalLM.from_pretrained(str(ft / name / "hf_peft")).eval()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        assert logits.shape[-1] == base_logits.shape[-1] and torch.isfinite(logits).all()
        assert not torch.allclose(logits[:, -5:], base_logits, atol=1e-4)  # the tuned part acts
    full = AutoModelForCausalLM.from_pretrained(str(ft / "tiny-full" / "hf")).eval()
    with torch.no_grad():
        full_logits = full(tokens).logits
    assert full_logits.shape == base_logits.shape and not torch.allclose(full_logits, base_logits, atol=1e-4)
    with tarfile.open(ft / "tiny-full" / "tiny-full.nemo") as tar:
        names = tar.getnames()
    assert "./model_config.yaml" in names and any(n.startswith("./model_weights/") for n in names)


def test_example_shows_learning(default_workflow: Workspace) -> None:
    """The shipped example's learning task, through Snakemake: the tuned model beats the base on exact match.

    config/examples/tiny-squad-finetune.yaml's tiny-counts (docs/finetuning-and-evaluation.md quotes its numbers):
    the base model answers none of the 60 held-out examples exactly; the tuned one most of them."""
    root = default_workflow.root
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    extra = yaml.safe_load((REPO / "config" / "examples" / "tiny-squad-finetune.yaml").read_text())
    cfg["sft_data"] = {"botchan-counts": extra["sft_data"]["botchan-counts"]}
    cfg["finetune"] = {"tiny-counts": extra["finetune"]["tiny-counts"]}
    cfg["resources"] = extra["resources"]  # as shipped: the fine-tune on 2 ranks
    ws = Workspace(root)
    ws.config_path = root / "config-example.yaml"
    ws.write_config(cfg)
    ws.run("runs/tiny/eval/tiny-counts/comparison.json", timeout=1800)
    comparison = json.loads((root / "runs" / "tiny" / "eval" / "tiny-counts" / "comparison.json").read_text())
    rows = {r["metric"]: r for r in comparison["metrics"]}
    print("example", {k: (r["base"], r["tuned"]) for k, r in rows.items()})
    em = rows["test_exact_string_match"]
    assert comparison["examples"] == 60 and em["base"] == 0.0
    assert em["tuned"] >= EXAMPLE_TUNED_EM and em["difference"] >= EXAMPLE_TUNED_EM
    assert rows["squad_exact_match"]["tuned"] >= EXAMPLE_TUNED_EM
    assert rows["test_loss"]["tuned"] < rows["test_loss"]["base"]
    assert comparison["newly_exact"] >= 60 * EXAMPLE_TUNED_EM
