"""Qwen3 through the commands, against transformers: ``snakellm import-hf``, ``generate --greedy``, ``export-hf``.

A tiny random ``Qwen3ForCausalLM`` (``Qwen3Config``, QK-norm perturbed away from 1, heads of 32 at
d=64 with 4 heads: a head size other than d / heads) saved by ``save_pretrained`` with GPT-2's BPE
files (the format of Qwen's ``vocab.json`` + ``merges.txt``): ``snakellm import-hf`` of it, then
``snakellm generate --greedy`` (the continuous-batching engine, CPU, fp32) gives transformers'
greedy tokens, and ``snakellm export-hf`` gives back a directory transformers loads into
``Qwen3ForCausalLM`` with identical tensors and logits; LoRA and full SFT of the imported model train,
and their PEFT adapter / merged and exported models load in peft and transformers. Each command is its
own process, as a user runs them: slow (2-3 min wall on 2 shared cores, ~50 s of CPU; end to end).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import env_with_venv
from hf_helpers import GPT2_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
PROMPTS = ["The history of", "In the beginning the"]
NEW = 16


def snakellm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = BIN / "snakellm"
    cmd = [str(exe) if exe.exists() else "snakellm", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _qwen3(src: Path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=50257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("weight"):
                p.mul_(5.0)  # sharper distributions than the 0.02 init: greedy ties are unlikely
    hf.save_pretrained(src)
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_DIR / f, src / f)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return hf


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory):
    """(work dir, the transformers model): ``src/`` as saved, ``run/`` as ``snakellm import-hf`` made it."""
    root = tmp_path_factory.mktemp("qwen3")
    hf = _qwen3(root / "src")
    snakellm("import-hf", str(root / "src"), str(root / "run"), cwd=root)
    return root, hf


@pytest.mark.slow
def test_qwen3_import_generate_export_through_the_commands(imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path, hf = imported
    model = json.loads((tmp_path / "run" / "checkpoints" / "run_config.json").read_text())["config"]["model"]
    assert (model["style"], model["kv_channels"], model["qk_norm"]) == ("qwen3", 32, True), model

    args = ["generate", str(tmp_path / "run"), "--greedy", "--max-new-tokens", str(NEW), "--device", "cpu"]
    args += [a for p in PROMPTS for a in ("--prompt", p)]
    out = snakellm(*args, "--out", str(tmp_path / "gen.jsonl"), cwd=tmp_path)
    assert out.returncode == 0
    rows = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tmp_path / "src")
    for prompt, row in zip(PROMPTS, rows, strict=True):
        x = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            y = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, eos_token_id=None
            )
        assert row["prompt"] == prompt and row["tokens"] == NEW
        assert row["completion"] == tok.decode(y[0, x.shape[1] :]), (prompt, row)

    snakellm("export-hf", str(tmp_path / "run"), str(tmp_path / "back"), cwd=tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_qwen3_lora_and_full_sft_through_the_commands(imported):
    """LoRA (PEFT adapter on transformers' Qwen3 base = the merged model) and full SFT (exported, loaded by
    transformers) of the imported model: both train (loss down) and move the logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, hf = imported
    data = root / "sft"
    data.mkdir(exist_ok=True)
    rows = [{"input": f"Question: what is {i} plus {i}? Answer:", "output": f" {2 * i}"} for i in range(12)]
    for split, part in (("train", rows[:8]), ("validation", rows[8:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    common = ["--base", "run", "--data-dir", "sft", "--steps", "6", "--micro-batch-size", "4"]
    common += ["--global-batch-size", "4", "--precision", "fp32", "--device", "cpu", "--threads", "1"]
    common += ["--no-progress", "--eval-interval", "3", "--lr-decay-style", "constant", "--select", "last"]
    lora = ["--lora-rank", "4", "--lora-targets", "linear_qkv,linear_proj,linear_fc1,linear_fc2", "--lr", "1e-2"]
    snakellm("finetune", *common, "--out-dir", "ft-lora", "--method", "lora", *lora, cwd=root)
    snakellm("finetune", *common, "--out-dir", "ft-full", "--method", "full", "--lr", "1e-3", cwd=root)
    for d in ("ft-lora", "ft-full"):
        summary = json.loads((root / d / "finetune_summary.json").read_text())
        assert summary["final_loss"] < summary["first_loss"], (d, summary)

    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(4))
    before = _logits(hf, ids)
    snakellm("lora", "export-peft", "--adapter", "ft-lora/adapter", "--out", "peft", "--base-model", "src", cwd=root)
    snakellm("lora", "merge-hf", "--base", "run", "--adapter", "ft-lora/adapter", "--out", "merged", cwd=root)
    base = AutoModelForCausalLM.from_pretrained(root / "src", dtype=torch.float32).eval()
    with_adapter = _logits(PeftModel.from_pretrained(base, root / "peft").eval(), ids)
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == "Qwen3ForCausalLM"
    assert (with_adapter - before).abs().max().item() > 1e-3
    assert (_logits(merged, ids) - with_adapter).abs().max().item() < 1e-4

    snakellm("export-hf", "ft-full/model", "full-hf", cwd=root)
    full = AutoModelForCausalLM.from_pretrained(root / "full-hf", dtype=torch.float32).eval()
    assert type(full).__name__ == "Qwen3ForCausalLM"
    assert (_logits(full, ids) - before).abs().max().item() > 1e-3


@pytest.mark.slow
def test_qwen3_training_figure_beside_llama_smoke(tmp_path: Path):
    """`bench_fp8_gpu.py --part speed --bf16-only --preset qwen3-8b --versus llama3-8b --num-layers 8` (issue 45's
    Qwen3 8B figure beside Llama 3.1 8B's) at tiny shapes on the CPU: both trained by `snakellm train` in one run,
    the hand-written reference with QK-norm, the ratio and its bar printed (~1-3 min: three training processes)."""
    import re
    import sys

    from conftest import REPO

    cmd = [sys.executable, str(REPO / "scripts" / "bench_fp8_gpu.py"), "--smoke", "--part", "speed", "--bf16-only"]
    cmd += ["--preset", "tiny-qwen3", "--versus", "tiny-llama", "--num-layers", "1"]
    env = {**env_with_venv(), "OUT": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^snakellm train bf16, tiny-qwen3\s+[\d,]+", out, re.M), out[-3000:]
    assert re.search(r"^snakellm train bf16, tiny-llama\s+[\d,]+", out, re.M), out[-3000:]
    assert re.search(r"^hand-written Llama bf16\s+[\d,]+", out, re.M), out[-3000:]
    m = re.search(r"ours bf16 tiny-qwen3 / ours bf16 tiny-llama: ([\d.]+)x in tokens/s, ([\d.]+)x in MFU", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out[-3000:]
    res = json.loads((tmp_path / "bench-fp8.json").read_text())["speed"]
    assert {r["name"] for r in res["rows"]} == {"speed-bf16", "versus-bf16", "reference-bf16"}
    assert res["verdict"]["versus"] == "tiny-llama"
