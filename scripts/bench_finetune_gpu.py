#!/usr/bin/env python3
"""GPU fine-tuning throughput of `snakellm finetune`: LoRA and full SFT (llama-1b, llama3-8b, llama2-7b).

Makes a llama-1b base checkpoint with random weights (the speed does not depend on
them) and SFT examples that fill the whole sequence (Botchan text as the prompt,
GPT-2 BPE, the vocabulary padded to 50304 as in scripts/bench_train_gpu.py), then
runs the real `snakellm finetune` once per method with no checkpoints and reads
tokens/s per step from its metrics.jsonl: the median over the steps after the
warm-up ones. MFU uses pretraining's formula (6 N + 12 L h s per token over the
989.4 TFLOP/s bf16 peak of an H100/H200), so it compares with `snakellm train`'s
figure for the same model, which --pretrain measures in the same run.

    python scripts/bench_finetune_gpu.py                        # lora + full on one GPU
    python scripts/bench_finetune_gpu.py --pretrain             # and snakellm train's llama-1b beside them
    python scripts/bench_finetune_gpu.py --smoke                # CPU, tiny model, seconds: the same code path
    python scripts/bench_finetune_gpu.py --tp 2 --steps 20 --lr 2e-5 --lr-warmup 5   # each method also TP over 2 GPUs
    python scripts/bench_finetune_gpu.py --preset llama3-8b --methods lora-all --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --steps 8 --warmup-steps 3 --tp 4 --tp-only   # the seed's layout
    python scripts/bench_finetune_gpu.py --preset llama3-8b --methods lora-all --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --steps 12 --warmup-steps 4 --compile --chat  # issue 44's bar
    python scripts/bench_finetune_gpu.py --preset llama3-8b --methods full --seq-length 4096 \
        --micro-batch-size 1 --global-batch-size 8 --steps 8 --warmup-steps 3 --fsdp --nproc 4 --tp-only  # FSDP SFT

With ``--chat`` each method also runs on multi-turn conversations (prepare-sft's ``messages``
records of a quarter to a whole sequence, the built-in ChatML template over the GPT-2 vocabulary,
the loss on the assistant turns, packed with block-diagonal attention: FlexAttention's block mask
by default, ``--packed-attention`` a comma list of dense, flex, varlen for one chat run each, with
their losses compared) right after its SQuAD-style
run, at the same shape and settings: tokens/s counting every position (as the trainer does; the
SQuAD rows are padded to the sequence too), the real and the trained tokens' rates beside it, and
the ratio to the SQuAD run (issue 44's bar: 0.95x).

Each row prints its tokens/s (per GPU), MFU, peak GPU memory and wall time beside the anchor
for the preset (NeMo AutoModel's Llama 3.1 8B LoRA on one H100 at sequence 4096: 12,473
tokens/s/GPU; NVIDIA's DGX Cloud Llama 3 8B on 8 H100s: LoRA 17,809, SFT 12,412).

With ``--tp N`` every method runs twice, on one GPU and tensor parallel over N
(torchrun, NCCL; the base checkpoint, written at TP 1, is resharded on load),
with the same data, seed and adapter initialisation: tokens/s per GPU, the
scaling efficiency, and the largest step-by-step relative loss difference
(bf16 tolerance: ``--rtol``).

With ``--fsdp`` each full fine-tune also runs with its parameters, gradients and optimizer states sharded
over ``--nproc`` GPUs (`snakellm finetune --fsdp`, FSDP2, data parallel under torchrun): tokens/s per GPU,
MFU (6 N + 12 L h s per token over 989.4 TFLOP/s) beside the bar (50%) and DGX Cloud's SFT anchor, and
peak memory (LoRA and p-tuning refuse FSDP: they skip it). ``--smoke`` runs the FSDP path too, on 2 gloo
ranks in fp32 at micro batch 1, whose losses must equal the one-process run's (1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from snakellm import models  # noqa: E402  (torch-free: the architecture and its FLOPs per token)

GPT2 = {
    "kind": "gpt2-bpe",
    "name": "gpt2",
    "vocab_size": 50257,
    "eod_id": 50256,
    "eod_token": "<|endoftext|>",
    "files": {
        "vocab_file": str(REPO / "resources/tokenizers/gpt2/vocab.json"),
        "merges_file": str(REPO / "resources/tokenizers/gpt2/merges.txt"),
    },
}
METHODS = {
    "lora": ["--method", "lora", "--lora-rank", "32", "--lora-targets", "linear_qkv"],
    "lora-all": [
        "--method",
        "lora",
        "--lora-rank",
        "32",
        "--lora-targets",
        "linear_qkv,linear_proj,linear_fc1,linear_fc2",
    ],
    "full": ["--method", "full"],
}
PEAK_TFLOPS = 989.4  # bf16 dense, H100 / H200 SXM: the MFU of every row (the metrics' own only on those GPUs)
MFU_BAR = 0.5  # full SFT of the Llama 3.1 8B shape on 4 GPUs (issue 31)
CHAT_BAR = 0.95  # conversations, packed, against the SQuAD examples at the same shape (issue 44)


def small_gpt2(root: Path, merges: int = 1024) -> dict:
    """GPT-2's BPE cut to its first ``merges`` merges (the 256 byte tokens, those merges' tokens, then
    <|endoftext|>): a valid BPE of the same kind whose output layer is ~50x smaller, for the CPU smokes (the
    GPT-2 vocabulary's output layer is most of a tiny model's CPU time, and in bf16 far more: this CPU has no
    bf16 matrix units). Every id keeps GPT-2's: merge ``i`` makes token ``256 + i``."""
    src = REPO / "resources/tokenizers/gpt2"
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    lines = (src / "merges.txt").read_text(encoding="utf-8").split("\n")
    kept = {tok: i for tok, i in vocab.items() if i < 256 + merges}
    eod = len(kept)
    kept["<|endoftext|>"] = eod
    d = root / f"gpt2-{merges}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "vocab.json").write_text(json.dumps(kept, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("\n".join(lines[: merges + 1]) + "\n", encoding="utf-8")
    files = {"vocab_file": str(d / "vocab.json"), "merges_file": str(d / "merges.txt")}
    return {**GPT2, "name": f"gpt2-{merges}", "vocab_size": eod + 1, "eod_id": eod, "files": files}


def make_base(root: Path, preset: str, seq: int, device: str, tokenizer: dict | None = None) -> Path:
    """A model-only checkpoint of random weights (what `snakellm finetune --base` reads), made in a subprocess;
    ``tokenizer``: the base's (default GPT-2's, in ``root/base``; another in ``root/NAME/base``, so that a cached
    base is never one of another vocabulary)."""
    run = root / "base" if tokenizer is None else root / tokenizer["name"] / "base"
    tokenizer = tokenizer or GPT2
    if (run / "checkpoints" / "latest_checkpointed_iteration.txt").exists():
        return run
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from snakellm.finetune import runtime
from snakellm.finetune.artifacts import save_model
from snakellm import models
from snakellm.models.build import build_model
if __name__ == "__main__":
    rt = runtime.start({device!r}, 1)
    arch = models.resolve({preset!r}, {{"seq_length": {seq}}})
    vocab = models.padded_vocab_size({tokenizer["vocab_size"]}, arch)
    gpt, _ = build_model(arch, vocab, device=str(rt.device), bf16=rt.cuda)
    save_model(gpt, __import__("pathlib").Path({str(run)!r}), arch, vocab, {tokenizer!r})
    runtime.stop()
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return run


ANCHORS = {  # tokens/s/GPU, published (bf16): (figure, source)
    ("llama3-8b", "lora"): (12473, "NeMo AutoModel, Llama 3.1 8B LoRA, one H100, seq 4096"),
    ("llama3-8b", "lora-all"): (12473, "NeMo AutoModel, Llama 3.1 8B LoRA, one H100, seq 4096"),
    ("llama3-8b", "full"): (12412, "DGX Cloud NeMo 24.12, Llama 3 8B SFT, 8 H100s, seq 4096"),
    ("llama2-7b", "lora-all"): (24824, "NeMo 24.07, Llama 2 7B LoRA FP8 packed, 8 H100s, seq 4096"),
}


def make_data(root: Path, n: int) -> Path:
    """SFT examples longer than the sequence (truncated from the left): every sequence is full."""
    text = (REPO / "resources/corpus/botchan/botchan.jsonl").read_text()
    docs = [json.loads(line)["text"] for line in text.splitlines()]
    long = " ".join(docs)
    d = root / "sft"
    d.mkdir(parents=True, exist_ok=True)
    recs = []
    for i in range(n):  # a different window of the book each, far longer than the sequence (truncated: left)
        start = (i * 997) % max(1, len(long) - 20000)
        recs.append({"input": long[start : start + 16000], "output": "the answer is " + str(i)})
    for split in ("train", "validation"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def make_chat_data(root: Path, n: int, seq: int) -> Path:
    """Multi-turn conversations (prepare-sft's messages records) of about a quarter to a whole sequence each:
    a system prompt, then user/assistant turns of Botchan text of varying lengths (packed by finetune)."""
    import random

    text = (REPO / "resources/corpus/botchan/botchan.jsonl").read_text()
    words = " ".join(json.loads(line)["text"] for line in text.splitlines()).split()
    rng = random.Random(1234)
    d = root / "chat"
    d.mkdir(parents=True, exist_ok=True)
    recs = []
    for _ in range(n):
        budget = rng.randint(seq // 4, seq - seq // 8)  # GPT-2 tokens, about 1.3 a word
        turns = [{"role": "system", "content": "You answer questions about the novel Botchan."}]
        used = 0
        while used < budget * 0.75 or len(turns) < 3:
            for role in ("user", "assistant"):
                k = rng.randint(20, max(21, seq // 16))
                start = rng.randrange(len(words) - k)
                turns.append({"role": role, "content": " ".join(words[start : start + k])})
                used += k + 6
        recs.append({"messages": turns})
    for split in ("train", "validation"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def run_method(name: str, a, base: Path, data: Path, out: Path, tp: int = 1, fsdp: int = 0, chat: str = "") -> dict:
    """One `snakellm finetune` of method ``name``: on one GPU, tensor parallel over ``tp`` or FSDP over ``fsdp``;
    ``chat``: on conversations (the ChatML template over the GPT-2 vocabulary, assistant turns trained, packed)
    with this packed attention (dense, flex or varlen)."""
    world = fsdp or tp
    odir = out / (f"{name}-fsdp{fsdp}" if fsdp else (name if tp == 1 else f"{name}-tp{tp}"))
    if chat:
        odir = odir.with_name(odir.name + f"-chat-{chat}")
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if world > 1:
        launch += [f"--nproc-per-node={world}"]
    tag = {"method": name, "tp": tp, **({"fsdp": fsdp} if fsdp else {})}
    tag |= {k: v for k, v in (("compile", a.compile), ("precision", a.precision)) if v}
    cmd = [
        *launch,
        "-m",
        "snakellm.cli",
        "finetune",
        "--base",
        str(base),
        "--data-dir",
        str(data),
        "--out-dir",
        str(odir),
        *METHODS[name],
        "--steps",
        str(a.steps),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--global-batch-size",
        str(a.global_batch_size),
        "--max-seq-length",
        str(a.seq_length),
        *(
            ["--chat-template", "chatml", "--train-on", "all_assistant", "--packing"] + ["--packed-attention", chat]
            if chat
            else ["--truncation-method", "left", "--pad-to-max"]
        ),
        "--eval-interval",
        str(a.steps + 1),
        "--eval-examples",
        "1",
        "--no-checkpoints",
        "--no-progress",
        "--device",
        a.device,
        "--lr",
        str(a.lr),
        "--warmup-steps",
        str(a.lr_warmup),
        "--tp",
        str(tp),
        "--resume",
        "never",
        *(["--fsdp"] if fsdp else []),
        *(["--profile-steps", a.profile_steps] if a.profile_steps else []),
        *(["--compile"] if a.compile else []),
        *(["--precision", a.precision] if a.precision else []),
    ]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if fsdp:  # as pretraining's 8B FSDP runs (scripts/bench_train_8b_gpu.py): FSDP's gathers fragment the cache
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t0 = time.time()
    rc, stderr = run_group(cmd, env, a.timeout)
    profile = None
    if (odir / "profile.txt").exists():  # --profile-steps: the kernel table beside the results
        profile = Path(a.out) / f"{odir.name}.profile.txt"
        profile.write_text((odir / "profile.txt").read_text())
    failed = None
    if rc is None:
        failed = f"timed out after {a.timeout:.0f} s"
    elif rc != 0:
        print(stderr[-3000:], file=sys.stderr)
        oom = "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr
        failed = "out of GPU memory" if oom else f"exit {rc}"
    # a job that fails after its steps (the final model's write, a time limit) still has its live metrics
    done, live = odir / "metrics.jsonl", odir / "checkpoints" / "metrics.live.jsonl"
    path = done if done.exists() and not failed else live
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steady = [r for r in recs if r["step"] > a.warmup_steps and "tokens_per_s" in r]
    tag["data"] = "chat" if chat else "squad"  # after the figures in each row (the smoke test reads their order)
    if chat:
        tag["packed_attention"] = chat
    if failed and not steady:
        return {**tag, "error": failed}
    steady = steady or recs
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    summary = json.loads((odir / "finetune_summary.json").read_text()) if not failed else {}
    arch = models.resolve(a.preset, {"seq_length": a.seq_length})
    flops = summary.get("flops_per_token") or models.flops_per_token(arch, models.padded_vocab_size(50257, arch))
    res = {
        **{k: v for k, v in tag.items() if k != "data"},
        "tokens_per_s": round(tps),
        "tokens_per_s_per_gpu": round(tps / world),
        # pretraining's formula over the H100/H200 bf16 peak, whatever the device (the CPU smoke's is tiny)
        "mfu_989": round(tps / world * flops / (PEAK_TFLOPS * 1e12), 6),
        "losses": [r["loss"] for r in recs if "loss" in r],
        "wall_s": round(time.time() - t0, 1),
        "trainable_parameters": summary.get("trainable_parameters"),
        "total_parameters": summary.get("total_parameters"),
        "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
        **({"profile": str(profile)} if profile else {}),
        **(token_rates(summary, tps / world, a.seq_length) if summary else {}),
        "data": tag["data"],
        **({"incomplete": f"{failed} after step {recs[-1]['step']} (figures from its live metrics)"} if failed else {}),
    }
    if failed:
        return res
    if steady[0].get("mfu") is not None:
        res["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
        # frozen weights skip their weight gradients: 2/3 of the work of 6 N, plus 6 per trainable parameter
        n, t = summary["total_parameters"], summary["trainable_parameters"]
        if t < n:
            res["mfu_adapter"] = round(
                res["mfu"] * (summary["flops_per_token"] * 2 / 3 + 6 * t) / summary["flops_per_token"], 4
            )
    return res


def token_rates(summary: dict, tps: float, seq: int) -> dict:
    """Beside tokens/s (every position of every sequence, padding included, as the trainer counts them):
    the rate of real tokens and of trained (loss-bearing) tokens, from the data's share of each."""
    enc = summary.get("encode") or {}
    rows = summary.get("sequences")
    if not rows:
        return {}
    if "trained_tokens" in enc:  # conversations: each example gives len - 1 positions
        real = enc["tokens"] - enc["examples"] + enc["skipped_too_long"]
        trained = enc["trained_tokens"]
    else:  # input/output examples filling the sequence (truncated from the left): the answer is trained
        real, trained = rows * seq, None
    out = {"real_tokens_per_s": round(tps * min(1.0, real / (rows * seq)))}
    if trained is not None:
        out["trained_tokens_per_s"] = round(tps * trained / (rows * seq))
    return out


def run_group(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None on time-out, stderr): the command in its own process group, all of which a
    time-out ends (torchrun's ranks too, which would otherwise hold their GPUs for the next stage)."""
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        err.seek(0)
        return rc, err.read()


def compare_losses(tp_losses: list[float], one: list[float], rtol: float, atol: float) -> dict:
    """Step by step, |tp - one| <= rtol * |one| + atol (bf16: relative where the loss is large, absolute
    where a memorised batch takes it towards 0, where relative differences of tiny numbers mean nothing)."""
    pairs = list(zip(tp_losses, one, strict=True))
    return {
        "max_abs_loss_diff": round(max(abs(x - y) for x, y in pairs), 5),
        "max_rel_loss_diff": round(max(abs(x - y) / abs(y) for x, y in pairs if abs(y) > 0.5), 5),
        "losses_match": all(abs(x - y) <= rtol * abs(y) + atol for x, y in pairs),
    }


def run_pretrain(a, root: Path) -> dict:
    """`snakellm train` on the same model, sequence and batch (random GPT-2 ids, bench_train_gpu's data)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_train_gpu import make_data as make_tokens

    blend = make_tokens(root / "pretrain", a.steps * a.global_batch_size * (a.seq_length + 1) * 2)
    run_dir = root / "runs" / "pretrain"
    cmd = [
        sys.executable,
        "-m",
        "snakellm.cli",
        "train",
        "--blend",
        str(blend),
        "--run-dir",
        str(run_dir),
        "--preset",
        a.preset,
        "--seq-length",
        str(a.seq_length),
        "--steps",
        str(a.steps),
        "--global-batch-size",
        str(a.global_batch_size),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--no-checkpoints",
        "--no-tensorboard",
        "--no-progress",
        "--split",
        "100,0,0",
        "--device",
        a.device,
        "--resume",
        "never",
    ]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"method": "pretrain", "error": proc.returncode}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in recs if r["step"] > a.warmup_steps and r.get("tokens_per_s")] or recs
    res = {"method": "pretrain", "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady))}
    if steady[0].get("mfu") is not None:
        res["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--methods", default="lora,full", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 steps: the same code path in seconds")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each method also on multi-turn conversations (ChatML, assistant turns trained, packed) beside the "
        "SQuAD-style examples, with the ratio of their tokens/s (smoke: on)",
    )
    p.add_argument(
        "--packed-attention",
        default="flex",
        help="--chat: the packed rows' block-diagonal attention, a comma list of dense, flex, varlen (one chat "
        "run each; examples.packed_attention; the smoke: dense, the only one with a CPU backward)",
    )
    p.add_argument("--tp-only", action="store_true", help="with --tp N or --fsdp: skip the one-GPU run of each method")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--pretrain", action="store_true", help="also snakellm train (scripts/bench_train_gpu.py) on the same model"
    )
    p.add_argument("--workdir", default="/tmp/snakellm-bench-ft")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="each run's kernel table over steps A..B (OUT/RUN.profile.txt)",
    )
    p.add_argument("--compile", action="store_true", help="snakellm finetune --compile (each layer torch.compile'd)")
    p.add_argument(
        "--precision",
        default=None,
        choices=("bf16", "fp8"),
        help="snakellm finetune --precision (default: its own, bf16 on a GPU); fp8: the frozen base's and the "
        "trained linears' matmuls in float8 (torchao)",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="fine-tuning lr (speed does not depend on it)")
    p.add_argument(
        "--lr-warmup",
        type=int,
        default=0,
        help="lr warm-up steps (a TP comparison of full SFT on random weights needs a gentle start: "
        "at lr 1e-4 from step 1 the loss jumps to ~19 and bf16 rounding then decides the trajectory)",
    )
    p.add_argument("--tp", type=int, default=1, help="also run each method tensor parallel over this many GPUs")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="also run each full method with FSDP (snakellm finetune --fsdp) over --nproc GPUs (smoke: 2 CPU ranks)",
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks of the --fsdp runs (data parallel, one per GPU)")
    p.add_argument("--rtol", type=float, default=0.02, help="TP vs one GPU: relative loss difference allowed")
    p.add_argument("--atol", type=float, default=0.02, help="TP vs one GPU: absolute loss difference allowed")
    p.add_argument(
        "--one-gpu-tokens-per-s",
        type=float,
        default=None,
        help="with --tp-only: the one-GPU figure measured elsewhere, for the scaling efficiency",
    )
    a = p.parse_args(argv)
    kernels = a.packed_attention.split(",")
    if bad := [k for k in kernels if k not in ("dense", "flex", "varlen")]:
        p.error(f"--packed-attention: {', '.join(bad)}: choose from dense, flex, varlen")
    if a.smoke:
        a.preset, a.seq_length, a.steps, a.warmup_steps = "tiny", 128, 3, 1
        # micro batch 1: one process and 2 data-parallel ranks average the same per-example losses
        a.micro_batch_size, a.global_batch_size, a.device, a.timeout = 1, 4, "cpu", 300
        a.fsdp, a.nproc, a.rtol, a.atol = True, 2, 1e-5, 1e-6  # the FSDP path too: fp32, the same losses
        a.chat, kernels = True, ["dense"]  # and the conversations' path (flex and varlen: no CPU backward)
        a.profile_steps = a.profile_steps or "2:2"  # and the kernel table of a step
        if a.workdir == p.get_default("workdir"):
            import tempfile

            a.workdir = tempfile.mkdtemp(prefix="bench-ft-smoke-")
        if a.out == p.get_default("out"):
            a.out = str(Path(a.workdir) / "out")
    root, out = Path(a.workdir), Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = small_gpt2(root, 8192) if a.smoke else None  # the smoke: GPT-2's first 8,192 merges (see small_gpt2)
    base = make_base(root / a.preset / str(a.seq_length), a.preset, a.seq_length, a.device, tok)
    print(f"base checkpoint ({a.preset}, random weights): {time.time() - t0:.0f} s", flush=True)
    data = make_data(root, max(64, a.global_batch_size * 2))
    chat = make_chat_data(root, max(96, a.global_batch_size * 6), a.seq_length) if a.chat else None
    results = []
    for m in a.methods.split(","):
        one = None
        if not (a.tp_only and (a.tp > 1 or (a.fsdp and m == "full"))):
            one = run_method(m, a, base, data, root / "runs")
            results.append(one)
            print(row(a.preset, one), flush=True)
        for kernel in kernels if chat is not None and not a.tp_only else []:  # conversations, same shape, same run
            conv = run_method(m, a, base, chat, root / "runs", chat=kernel)
            if "error" not in conv and one and "error" not in one:
                conv["vs_squad"] = round(conv["tokens_per_s"] / one["tokens_per_s"], 4)
                conv["chat_bar"] = "PASS" if conv["vs_squad"] >= CHAT_BAR else "FAIL"
            results.append(conv)
            print(row(a.preset, conv), flush=True)
            if "vs_squad" in conv:
                print(
                    f"chat {m} ({kernel}): {conv['tokens_per_s']:,} tokens/s (all positions; real "
                    f"{conv.get('real_tokens_per_s', 0):,}, trained {conv.get('trained_tokens_per_s', 0):,}) vs "
                    f"SQuAD {one['tokens_per_s']:,}: {conv['vs_squad']:.3f}x (bar {CHAT_BAR}x: {conv['chat_bar']})",
                    flush=True,
                )
        convs = [r for r in results if r.get("data") == "chat" and r["method"] == m and "losses" in r]
        for c in convs[1:]:  # the kernels compute one attention: the same losses up to bf16 rounding
            diff = max(abs(x - y) for x, y in zip(c["losses"], convs[0]["losses"]))
            c["loss_diff_vs_" + convs[0]["packed_attention"]] = round(diff, 5)
            print(f"chat {m}: {c['packed_attention']} vs {convs[0]['packed_attention']} losses: max |diff| {diff:.4f}")
        if a.tp > 1:
            par = run_method(m, a, base, data, root / "runs", tp=a.tp)
            ref = one["tokens_per_s"] if one and "error" not in one else a.one_gpu_tokens_per_s
            if "error" not in par and ref:
                par["scaling_efficiency"] = round(par["tokens_per_s_per_gpu"] / ref, 4)
            if "error" not in par and one and "error" not in one:
                par.update(compare_losses(par["losses"], one["losses"], a.rtol, a.atol))
            results.append(par)
            print(row(a.preset, par), flush=True)
        if a.fsdp and m == "full":
            sh = run_method(m, a, base, data, root / "runs", fsdp=a.nproc)
            if "error" not in sh and one and "error" not in one:
                sh.update(compare_losses(sh["losses"], one["losses"], a.rtol, a.atol))
            results.append(sh)
            print(row(a.preset, sh), flush=True)
    if a.pretrain:
        results.append(run_pretrain(a, root))
        print(json.dumps(results[-1]), flush=True)
    (out / "bench_finetune.json").write_text(json.dumps(results, indent=2) + "\n")
    if a.smoke:  # the path ran: a loss per step, a throughput
        ok = all(
            "error" not in r and "incomplete" not in r and len(r["losses"]) == a.steps and r["tokens_per_s"] > 0
            for r in results
        )
        ok = ok and all(r.get("losses_match", True) for r in results)  # FSDP's: the one-process losses
        ok = ok and all(r.get("profile") for r in results if "method" in r)  # --profile-steps' tables
        ok = ok and all(
            r.get("trained_tokens_per_s", 0) > 0 and "vs_squad" in r for r in results if r.get("data") == "chat"
        )
        ok = ok and any(r.get("fsdp") for r in results) == ("full" in a.methods.split(","))
        print("smoke:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    return 0 if all("error" not in r and "incomplete" not in r and r.get("losses_match", True) for r in results) else 1


def row(preset: str, r: dict) -> str:
    """One result as a line: the figure beside its anchor (where one is published for the preset), MFU
    (beside the bar for full SFT) and peak memory."""
    layout = f"fsdp {r['fsdp']}" if r.get("fsdp") else f"tp {r.get('tp', 1)}"
    if "error" in r:
        return f"{r['method']} {layout}: FAILED ({r['error']})"
    anchor = ANCHORS.get((preset, r["method"]))
    vs = f" vs {anchor[0]:,} ({anchor[1]}): {r['tokens_per_s_per_gpu'] / anchor[0]:.2f}x" if anchor else ""
    mfu = r["mfu_989"]
    bar = f", bar {MFU_BAR:.0%}: {'PASS' if mfu >= MFU_BAR else 'FAIL'}" if r["method"] == "full" else ""
    figures = f"MFU {mfu:.1%} (6N + 12Lhs over {PEAK_TFLOPS} TFLOP/s{bar}), peak {r.get('peak_gpu_memory_gib')} GiB"
    extra = {k: v for k, v in r.items() if k not in ("losses",)}
    note = f" (INCOMPLETE: {r['incomplete']})" if "incomplete" in r else ""
    return (
        f"{r['method']} {layout}: {r['tokens_per_s_per_gpu']:,} tokens/s/GPU{vs}; {figures}{note} | {json.dumps(extra)}"
    )


if __name__ == "__main__":
    sys.exit(main())
