#!/usr/bin/env python3
"""LoRA-DPO throughput on one GPU: `snakellm finetune --method dpo` beside TRL's DPOTrainer + peft LoRA.

The same shape on both sides (default: Llama 3.1 8B's, GPT-2's tokenizer, random weights: the speed
does not depend on them), the same pairs (1,024 prompt tokens and long completions, every sequence cut
to ``--max-length`` 2,048 tokens by both tokenizations), the same batch (``--global-batch-size`` pairs a
step), LoRA of the same rank on the same seven projections (ours: linear_qkv, linear_proj, linear_fc1,
linear_fc2), bf16, the reference's log-probabilities precomputed on both sides (ours: the
``reference_logprobs`` target, `snakellm reference-logprobs`, timed apart; TRL: ``precompute_ref_log_probs``,
before its steps). Tokens/s counts the chosen and the rejected sequence of every pair, prompt included in
both (TRL's ``num_tokens``); each side's figure is its median step after ``--warmup-steps``.

    python scripts/bench_dpo_gpu.py                  # Llama 3.1 8B shape, one GPU: ours, TRL, the ratio (bar 1.5x)
    python scripts/bench_dpo_gpu.py --smoke          # CPU, tiny Llama, 2 steps a side: the same code path
    python scripts/bench_dpo_gpu.py --only ours      # or --only trl

Reference for scale (issue 46, one H200, this shape and batch): TRL 1.16 DPOTrainer 7,053 tokens/s
(4.65 s a step, 30.9 GiB); snakellm's SFT LoRA at the same shape 15,777 tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_finetune_gpu import GPT2, make_base  # noqa: E402  (one way to make a random base checkpoint)

from snakellm import models  # noqa: E402

TRL_REFERENCE = 7053.0  # tokens/s, TRL 1.16 DPOTrainer, one H200 (issue 46)
BAR = 1.5
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUR_TARGETS = "linear_qkv,linear_proj,linear_fc1,linear_fc2"


def gpt2_encoder():
    from snakellm.finetune.runtime import load_tokenizer

    return load_tokenizer(GPT2)


def make_pairs(root: Path, n: int, prompt_tokens: int, completion_tokens: int) -> Path:
    """``n`` pairs cut from Botchan: a prompt of about ``prompt_tokens`` GPT-2 tokens, completions longer than
    ``completion_tokens`` (so both tokenizations cut each sequence at max_length), prepared as DPO reads them."""
    from snakellm.finetune.sft_data import prepare

    tok = gpt2_encoder()
    text = " ".join(
        json.loads(x)["text"] for x in (REPO / "resources/corpus/botchan/botchan.jsonl").read_text().splitlines()
    )
    ids = tok.encode(text)
    span = prompt_tokens + 2 * (completion_tokens + 64)
    recs = []
    for i in range(n):
        s = (i * 1031) % max(1, len(ids) - span)
        p = tok.decode(ids[s : s + prompt_tokens])
        c = tok.decode(ids[s + prompt_tokens : s + prompt_tokens + completion_tokens + 64])
        r = tok.decode(ids[s + prompt_tokens + completion_tokens + 64 : s + span])
        recs.append({"prompt": p, "chosen": c, "rejected": r})
    src = root / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    prepare(str(src), str(root / "prefs"), fmt="preference", split="100,0,0", seed=0)
    return root / "prefs"


def run(cmd: list[str], timeout: float) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd[:6])} ...")


def ours(a, root: Path, base: Path, data: Path) -> dict:
    """The reference target once, then `snakellm finetune --method dpo` (LoRA policy) from it."""
    snk = [sys.executable, "-m", "snakellm.cli"]
    ref = root / "reference_logprobs.json"
    common = ["--dpo-max-length", str(a.max_length), "--max-seq-length", str(a.max_length)]
    t0 = time.time()
    run(
        [*snk, "reference-logprobs", "--model", str(base), "--data-dir", str(data), "--out", str(ref), *common]
        + ["--device", a.device, "--batch-size", str(a.micro_batch_size)],
        a.timeout,
    )
    ref_s = time.time() - t0
    out = root / "ours"
    t0 = time.time()
    run(
        [*snk, "finetune", "--base", str(base), "--data-dir", str(data), "--out-dir", str(out), "--method", "dpo"]
        + ["--dpo-policy", "lora", "--dpo-beta", "0.1", "--reference-logprobs", str(ref), *common]
        + ["--lora-rank", str(a.rank), "--lora-alpha", str(a.rank), "--lora-targets", OUR_TARGETS]
        + ["--steps", str(a.steps), "--micro-batch-size", str(a.micro_batch_size)]
        + ["--global-batch-size", str(a.global_batch_size), "--lr", "1e-4", "--eval-interval", str(a.steps + 1)]
        + ["--no-checkpoints", "--no-progress", "--device", a.device, "--resume", "never"]
        + (["--compile"] if a.compile else [])
        + (["--recompute", a.recompute] if a.recompute != "none" else []),
        a.timeout,
    )
    wall = time.time() - t0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "tokens_per_s" in r]
    # the metrics' tokens/s counts global_batch x seq_length a step; a step's pair tokens are those of the pairs
    seq = a.max_length
    step_s = [a.global_batch_size * seq / r["tokens_per_s"] for r in steps[a.warmup_steps :] or steps]
    summary = json.loads((out / "finetune_summary.json").read_text())
    return {
        "side": "ours",
        "step_s": statistics.median(step_s),
        "tokens_per_step": pair_tokens(a, data),
        "peak_gib": summary.get("peak_gpu_memory_gib"),
        "losses": [r["loss"] for r in steps],
        "reference_s": round(ref_s, 1),
        "wall_s": round(wall, 1),
    }


def pair_tokens(a, data: Path) -> int:
    """Chosen + rejected tokens of a step's pairs after truncation (prompt counted in both): as TRL counts."""
    from snakellm.finetune import dataset as ds
    from snakellm.finetune import preference as pref

    pairs, _ = pref.encode_pairs(
        gpt2_encoder(), ds.read_jsonl(data / "train.jsonl", pref.KEYS), pref.Truncation(a.max_length)
    )
    per = statistics.mean(len(p.chosen.ids) + len(p.rejected.ids) for p in pairs)
    return round(per * a.global_batch_size)


TRL_WORKER = r"""
import json, statistics, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer

cfg = json.loads(sys.argv[1])
cuda = cfg["device"] == "cuda"
tok = AutoTokenizer.from_pretrained(cfg["tokenizer_dir"])  # GPT-2's, as export-hf writes it
tok.pad_token = tok.eos_token
arch = cfg["arch"]
hc = LlamaConfig(
    vocab_size=50257, hidden_size=arch["hidden_size"], intermediate_size=arch["ffn_hidden_size"],
    num_hidden_layers=arch["num_layers"], num_attention_heads=arch["num_attention_heads"],
    num_key_value_heads=arch["num_query_groups"], max_position_embeddings=cfg["max_length"],
    rope_theta=arch["rotary_base"], rms_norm_eps=arch["layernorm_epsilon"], tie_word_embeddings=False,
    bos_token_id=50256, eos_token_id=50256, pad_token_id=50256,
)
torch.manual_seed(0)
dtype = torch.bfloat16 if cuda else torch.float32
torch.set_default_dtype(dtype)
with torch.device("cuda" if cuda else "cpu"):
    model = LlamaForCausalLM(hc)
torch.set_default_dtype(torch.float32)
pairs = [json.loads(x) for x in open(cfg["pairs"])]
micro = cfg["trl_micro"]
args = DPOConfig(
    output_dir=cfg["out"], beta=0.1, max_length=cfg["max_length"], precompute_ref_log_probs=True,
    per_device_train_batch_size=micro, gradient_accumulation_steps=cfg["global_batch"] // micro,
    max_steps=cfg["steps"], learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no",
    bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0, seed=0,
)
lora = LoraConfig(r=cfg["rank"], lora_alpha=cfg["rank"], lora_dropout=0.0, target_modules=cfg["targets"],
                  task_type="CAUSAL_LM")
times = []

class Clock(TrainerCallback):
    def on_step_begin(self, *a, **k):
        if cuda: torch.cuda.synchronize()
        self.t = time.perf_counter()
    def on_step_end(self, *a, **k):
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - self.t)

t0 = time.time()
trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok,
                     peft_config=lora, callbacks=[Clock()])
prep = time.time() - t0
if cuda: torch.cuda.reset_peak_memory_stats()
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
# TRL's own count: num_tokens, the attention masks' sum over the steps so far (prompt in both sequences)
counted = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
print("TRL_RESULT " + json.dumps({
    "step_times": times, "tokens_per_step": counted[-1] / len(counted), "num_tokens": counted,
    "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    "losses": losses, "setup_s": round(prep, 1),
}))
"""


def trl(a, root: Path, data: Path, arch: dict) -> dict:
    from snakellm.export.hf_tokenizer import export_tokenizer

    tok_dir = root / "hf_tokenizer"
    tok_dir.mkdir(exist_ok=True)
    export_tokenizer(GPT2, tok_dir)
    cfg = {
        "device": a.device,
        "tokenizer_dir": str(tok_dir),
        "arch": arch,
        "max_length": a.max_length,
        "pairs": str(data / "train.jsonl"),
        "trl_micro": a.trl_micro_batch_size,
        "global_batch": a.global_batch_size,
        "steps": a.steps,
        "rank": a.rank,
        "targets": HF_TARGETS,
        "out": str(root / "trl"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", TRL_WORKER, json.dumps(cfg)], capture_output=True, text=True, timeout=a.timeout
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
    if proc.returncode or line is None:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"TRL's run failed ({proc.returncode})")
    r = json.loads(line.removeprefix("TRL_RESULT "))
    times = r["step_times"][a.warmup_steps :] or r["step_times"]
    return {
        "side": "trl",
        "step_s": statistics.median(times),
        "tokens_per_step": round(r["tokens_per_step"]),
        "peak_gib": r["peak_gib"],
        "num_tokens": r["num_tokens"],
        "losses": r["losses"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny Llama, 2 steps a side: the same code path")
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--max-length", type=int, default=2048, help="tokens a sequence (both sides cut to it)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, default=8, help="pairs a step")
    p.add_argument("--micro-batch-size", type=int, default=1, help="ours: pairs a forward pass")
    p.add_argument("--trl-micro-batch-size", type=int, default=8, help="TRL: per_device_train_batch_size")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"), help="ours")
    p.add_argument("--compile", action="store_true", help="ours: torch.compile each layer")
    p.add_argument("--only", choices=("ours", "trl"), default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.max_length, a.prompt_tokens, a.device = "tiny-llama", 96, 48, "cpu"
        a.global_batch_size, a.micro_batch_size, a.trl_micro_batch_size = 2, 1, 2
        a.steps, a.warmup_steps, a.rank = 2, 0, 4
    root = Path(a.workdir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench-dpo-")) / "bench-dpo"
    root.mkdir(parents=True, exist_ok=True)
    arch = models.resolve(a.preset, {"seq_length": a.max_length})
    data = make_pairs(root, a.global_batch_size * 2, a.prompt_tokens, a.max_length)
    print(
        f"shape {a.preset} ({arch['num_layers']} layers, d={arch['hidden_size']}), pairs of {a.max_length} tokens "
        f"({a.prompt_tokens} prompt), {a.global_batch_size} pairs a step, LoRA rank {a.rank} on all seven "
        f"projections, {'bf16' if a.device == 'cuda' else 'fp32 CPU'}; median step after {a.warmup_steps}"
    )
    results = {}
    if a.only in (None, "ours"):
        base = make_base(root, a.preset, a.max_length, a.device)
        results["ours"] = r = ours(a, root, base, data)
        tps = r["tokens_per_step"] / r["step_s"]
        print(
            f"ours: snakellm finetune --method dpo (LoRA): {tps:,.0f} tokens/s ({r['step_s']:.3f} s/step, "
            f"{r['tokens_per_step']:,} tokens a step, peak {r['peak_gib']} GiB); reference_logprobs target "
            f"{r['reference_s']} s, once"
        )
    if a.only in (None, "trl"):
        results["trl"] = r = trl(a, root, data, arch)
        tps = r["tokens_per_step"] / r["step_s"]
        print(
            f"TRL DPOTrainer + peft LoRA: {tps:,.0f} tokens/s ({r['step_s']:.3f} s/step, {r['tokens_per_step']:,} "
            f"tokens a step, peak {r['peak_gib']} GiB); issue 46's measurement on one H200: {TRL_REFERENCE:,.0f}"
        )
    if len(results) == 2:
        o, t = (results[k]["tokens_per_step"] / results[k]["step_s"] for k in ("ours", "trl"))
        verdict = "PASS" if o >= BAR * t else "FAIL"
        print(f"ours / TRL: {o / t:.2f}x (bar {BAR}x): {verdict}" + (" (smoke: CPU, not the bar)" if a.smoke else ""))
    (root / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
