#!/usr/bin/env python3
"""Megatron-LM's own pretrain_gpt.py continues a snakellm checkpoint: same first loss, on one GPU.

For a small GPT (learned positions, GELU, LayerNorm, tied embeddings) and a small
Llama-style model (RoPE, SwiGLU, RMSNorm, grouped-query attention, untied), on
random GPT-2 token ids written as Megatron .bin/.idx:

1. ``snakellm train`` (bf16, one GPU) runs 2K steps, saving at K and 2K: our losses
   at every step;
2. Megatron-LM core_v0.16.1's ``pretrain_gpt.py`` (a copy of its source in
   ``--megatron-lm``, never committed: ``git archive core_v0.16.1 pretrain_gpt.py
   gpt_builders.py model_provider.py megatron/training megatron/legacy
   megatron/post_training megatron/rl | tar -x -C .bench/megatron-lm``; megatron-core
   itself is the installed 0.16.1 wheel) starts with ``--load`` from our
   iteration K (``--transformer-impl local``, no Transformer Engine, no apex, its
   C++/CUDA build steps skipped: the wheel's dataset helpers are prebuilt) on the same
   .bin/.idx and trains to 2K;
3. its first loss (iteration K+1: the loaded weights on the batch our run saw at
   K+1, which needs the data position from our checkpoint's ``args``) must equal
   ours within bf16 tolerance (1%); the later ones are printed beside ours
   (``--no-load-optim``: Megatron-LM's scheduler counts samples, ours iterations, so
   its Adam states and learning rate restart).

``--cpu``: what runs without a GPU: the checkpoints on CPU (tiny models, fp32),
then Megatron-LM's argument parser and ``validate_args`` on the GPU run's command
line, ``check_checkpoint_args`` against our checkpoint's args (what its
``load_checkpoint`` does), ``load_args_from_checkpoint`` (its ``--use-checkpoint-args``:
which model arguments it would take from ours), and its own model
(``gpt_builders.gpt_builder``, the local spec, as ``pretrain_gpt.py`` builds it)
loaded strictly from our checkpoint, with its logits on random tokens beside those
of our model loaded from the same checkpoint (measured: 2e-7 and 3e-7, fp32).

    python scripts/check_megatron_lm_gpu.py --megatron-lm .bench/megatron-lm          # GPU, ~2-3 min
    python scripts/check_megatron_lm_gpu.py --megatron-lm .bench/megatron-lm --cpu    # here, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
VOCAB = 50257  # GPT-2's; Megatron-LM's NullTokenizer --vocab-size 50256 has the same size and end-of-document id

# (name, snakellm model flags, GPU sizes, CPU sizes)
MODELS = {
    "gpt": ["--preset", "gpt2-124m", "--num-layers", "4"],
    "llama": ["--preset", "tiny-llama", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8"]
    + ["--num-query-groups", "2", "--ffn-hidden-size", "1408"],
}
CPU_MODELS = {"gpt": ["--preset", "tiny"], "llama": ["--preset", "tiny-llama"]}
TRAIN = dict(lr=3e-4, min_lr=3e-5, warmup=2, weight_decay=0.1, beta1=0.9, beta2=0.95, clip=1.0, seed=1234)

# Megatron-LM run flags with no snakellm counterpart, set so that it computes what we did
KERNEL_FLAGS = [
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
]


def run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None, timeout: float = 600) -> int:
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        return subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env or os.environ.copy(), cwd=cwd, timeout=timeout
        ).returncode


def snakellm_run(name: str, args, blend: Path, work: Path, out: Path) -> tuple[Path, dict[int, float], dict]:
    """Train ``2K`` steps with checkpoints at K and 2K; our losses and the run directory."""
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    k = args.k
    cmd = [sys.executable, "-m", "snakellm.cli", "train", "--blend", str(blend), "--run-dir", str(run_dir)]
    cmd += (CPU_MODELS if args.cpu else MODELS)[name]
    cmd += ["--seq-length", str(args.seq), "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.gbs)]
    cmd += ["--steps", str(2 * k), "--save-interval", str(k), "--keep-last", "2", "--log-interval", "1"]
    cmd += ["--eval-iters", "0", "--split", "100,0,0", "--no-progress", "--no-tensorboard"]
    t = TRAIN
    cmd += ["--lr", str(t["lr"]), "--min-lr", str(t["min_lr"]), "--warmup-steps", str(t["warmup"])]
    cmd += ["--weight-decay", str(t["weight_decay"]), "--adam-beta1", str(t["beta1"]), "--adam-beta2", str(t["beta2"])]
    cmd += ["--clip-grad", str(t["clip"]), "--seed", str(t["seed"]), "--lr-decay-style", "cosine"]
    cmd += ["--precision", "fp32", "--device", "cpu", "--threads", "2"] if args.cpu else ["--precision", "bf16"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rc = run(cmd, out / f"snakellm-{name}.log", env=env)
    if rc != 0:
        raise SystemExit(f"snakellm train ({name}) failed: see {out / f'snakellm-{name}.log'}")
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r}
    summary = json.loads((run_dir / "train_summary.json").read_text())
    # Megatron-LM loads the latest iteration: make it K
    ckpt = work / "load" / name
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / f"iter_{k:07d}", ckpt / f"iter_{k:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{k}\n")
    return ckpt, losses, summary


def megatron_flags(name: str, args, summary: dict, prefix: str, load: Path) -> list[str]:
    """pretrain_gpt.py's command line: the model from our args' mapping, the run as ours."""
    from snakellm.models.megatron_args import megatron_lm_args

    a = megatron_lm_args(summary["model"], summary["padded_vocab_size"])
    f = ["--num-layers", a["num_layers"], "--hidden-size", a["hidden_size"], "--ffn-hidden-size", a["ffn_hidden_size"]]
    f += ["--num-attention-heads", a["num_attention_heads"], "--seq-length", a["seq_length"]]
    f += ["--max-position-embeddings", a["max_position_embeddings"]]
    f += ["--position-embedding-type", a["position_embedding_type"], "--normalization", a["normalization"]]
    f += ["--norm-epsilon", a["norm_epsilon"], "--init-method-std", a["init_method_std"]]
    f += ["--hidden-dropout", a["hidden_dropout"], "--attention-dropout", a["attention_dropout"]]
    f += ["--make-vocab-size-divisible-by", a["make_vocab_size_divisible_by"]]
    if a["group_query_attention"]:
        f += ["--group-query-attention", "--num-query-groups", a["num_query_groups"]]
    if a["position_embedding_type"] == "rope":
        f += ["--rotary-base", a["rotary_base"], "--no-position-embedding"]
    if a["use_rope_scaling"]:
        f += ["--use-rope-scaling", "--rope-scaling-factor", a["rope_scaling_factor"]]
    if a["swiglu"]:
        f += ["--swiglu"]
    if not a["add_bias_linear"]:
        f += ["--disable-bias-linear"]
    if a["add_qkv_bias"] and not a["add_bias_linear"]:
        f += ["--add-qkv-bias"]
    if a["untie_embeddings_and_output_weights"]:
        f += ["--untie-embeddings-and-output-weights"]
    t, k = TRAIN, args.k
    f += ["--micro-batch-size", args.mbs, "--global-batch-size", args.gbs, "--train-iters", 2 * k]
    f += ["--lr", t["lr"], "--min-lr", t["min_lr"], "--lr-decay-style", "cosine", "--lr-warmup-iters", t["warmup"]]
    f += ["--lr-decay-iters", 2 * k, "--weight-decay", t["weight_decay"], "--adam-beta1", t["beta1"]]
    f += ["--adam-beta2", t["beta2"], "--clip-grad", t["clip"], "--seed", t["seed"]]
    f += ["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB - 1]
    f += ["--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1", "--load", load]
    f += ["--ckpt-format", "torch_dist", "--no-load-optim", "--no-load-rng", "--exit-on-missing-checkpoint"]
    f += ["--data-cache-path", str(Path(args.work) / "mlm-cache" / name), "--num-workers", "0"]
    f += KERNEL_FLAGS
    if not args.cpu:
        f += ["--bf16"]
    return [str(x) for x in f]


# run inside Megatron-LM's tree: its build steps skipped (the wheel's dataset helpers are prebuilt, and its fused
# CUDA kernels need nvcc and are off by the flags above), then pretrain_gpt.py as its own __main__
WRAPPER = """
import runpy, sys, warnings
warnings.filterwarnings("ignore")
import megatron.training.initialize as init
init._compile_dependencies = lambda: None
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""

# --cpu: Megatron-LM's parser and its checkpoint-args reader against our checkpoint
ARGS_PROBE = """
import copy, sys, warnings, json
warnings.filterwarnings("ignore")
from megatron.training.arguments import parse_args, validate_args
from megatron.training import checkpointing as c
import megatron.training.global_vars as gv
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
args = parse_args()
validate_args(args)
gv.set_args(args)
# what load_checkpoint does with the GPU run's command line: read our common state, check its args against it
state, _, _, _ = c._load_base_checkpoint(args.load, args, rank0=True)
ckpt_args = state["args"]
c.set_checkpoint_version(state.get("checkpoint_version", 0))
c.check_checkpoint_args(ckpt_args)
# and --use-checkpoint-args: which model arguments it takes from ours
probe = copy.deepcopy(args)
probe.use_checkpoint_args = True
before = dict(vars(probe))
c.load_args_from_checkpoint(probe)
ours = vars(ckpt_args)
theirs_model = ["num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
    "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
    "padded_vocab_size", "ckpt_format", "tensor_model_parallel_size", "pipeline_model_parallel_size"]
missing = [k for k in theirs_model if k not in ours]
differ = {k: [str(ours[k]), str(before.get(k))] for k in theirs_model if k in ours and before.get(k) is not None
          and ours[k] != before.get(k) and k not in ("padded_vocab_size", "ckpt_format")}
# their model (gpt_builder: the local spec as pretrain_gpt.py builds it, on the CPU), loaded from our checkpoint
# strictly, against ours loaded by snakellm: the same logits on the same tokens
import torch
from megatron.core import dist_checkpointing
from megatron.training.arguments import core_transformer_config_from_args
from gpt_builders import gpt_builder
from snakellm.launch import runtime
from snakellm.models.build import build_model
runtime.ensure_single_process("cpu", seed=args.seed)
args.use_cpu_initialization = True
args.padded_vocab_size = ckpt_args.padded_vocab_size
config = core_transformer_config_from_args(args)
config.use_cpu_initialization = True
theirs = gpt_builder(args, True, True, config=config)
path = f"{args.load}/iter_{state['iteration']:07d}"
theirs.load_state_dict(dist_checkpointing.load({"model": theirs.sharded_state_dict()}, path)["model"], strict=True)
import json as _j, pathlib
summary = _j.loads(pathlib.Path(SUMMARY).read_text())
mine, _ = build_model(summary["model"], summary["padded_vocab_size"])
mine.load_state_dict(dist_checkpointing.load({"model": mine.sharded_state_dict()}, path)["model"], strict=True)
tokens = torch.randint(0, 50000, (2, args.seq_length))
pos = torch.arange(args.seq_length).unsqueeze(0).expand(2, -1)
mask = torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool).tril().logical_not()
theirs.eval(); mine.eval()
with torch.no_grad():
    a = theirs(tokens, pos, mask)
    b = mine(tokens, pos, None)
logits_diff = float((a - b).abs().max())
print(json.dumps({"iteration": state["iteration"], "their_model_loaded_strict": True,
                  "max_logit_difference": logits_diff, "consumed_train_samples": ours.get("consumed_train_samples"),
                  "check_checkpoint_args": "passed", "missing_model_args": missing,
                  "differ_from_command_line": differ, "padded_vocab": [ours["padded_vocab_size"], args.padded_vocab_size]}))
"""


def megatron_run(name: str, args, flags: list[str], out: Path) -> tuple[int, dict[int, float], str]:
    mlm = Path(args.megatron_lm).resolve()
    env = {**os.environ, "PYTHONPATH": f"{mlm}{os.pathsep}{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + len(name)))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    log = out / f"megatron-lm-{name}{'-args' if args.cpu else ''}.log"
    code = (
        ARGS_PROBE.replace("SUMMARY", repr(str(Path(args.work) / "runs" / name / "train_summary.json")))
        if args.cpu
        else WRAPPER
    )
    rc = run([sys.executable, "-c", code, *flags], log, env=env, cwd=mlm, timeout=args.timeout)
    text = log.read_text(errors="replace")
    losses = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)", text)
    }
    return rc, losses, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--megatron-lm", default=str(REPO / ".bench" / "megatron-lm"), help="Megatron-LM source copy")
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--k", type=int, default=10, help="the checkpoint Megatron-LM loads (we train 2K steps)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--rtol", type=float, default=0.01, help="bf16 tolerance of the first loss")
    p.add_argument("--cpu", action="store_true", help="no GPU: checkpoints on CPU, Megatron-LM's argument side only")
    p.add_argument("--work", default="/tmp/snakellm-megatron-lm")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    if args.cpu:
        args.seq, args.k = 64, 3
    if not (Path(args.megatron_lm) / "pretrain_gpt.py").exists():
        p.error(f"{args.megatron_lm}/pretrain_gpt.py not found (see the module docstring for the git archive command)")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    from bench_train_gpu import make_data

    blend = make_data(work / "data", int(4 * args.k * args.gbs * (args.seq + 1) * 1.1), vocab=VOCAB)
    prefix = json.loads(blend.read_text())["data_prefix"][1]
    ok = True
    for name in args.models.split(","):
        ckpt, ours, summary = snakellm_run(name, args, blend, work, out)
        flags = megatron_flags(name, args, summary, prefix, ckpt)
        rc, theirs, text = megatron_run(name, args, flags, out)
        if args.cpu:
            probe = [ln for ln in text.splitlines() if ln.startswith("{")]
            print(f"{name}: Megatron-LM load_args_from_checkpoint rc={rc}: {probe[-1] if probe else text[-2000:]}")
            ok = ok and rc == 0 and bool(probe) and json.loads(probe[-1])["missing_model_args"] == []
            continue
        k = args.k
        print(f"\n{name}: Megatron-LM pretrain_gpt.py --load {ckpt} (iteration {k}) rc={rc}")
        print(f"{'iteration':>9s} {'snakellm':>10s} {'Megatron-LM':>12s} {'rel diff':>9s}")
        for it in range(k + 1, 2 * k + 1):
            a, b = ours.get(it), theirs.get(it)
            rel = abs(a - b) / abs(a) if a is not None and b is not None else None
            print(
                f"{it:>9d} {a if a is not None else float('nan'):>10.4f} {b if b is not None else float('nan'):>12.4f} "
                f"{rel if rel is not None else float('nan'):>9.2%}"
            )
        first = theirs.get(k + 1)
        same = first is not None and abs(first - ours[k + 1]) <= args.rtol * abs(ours[k + 1])
        print(
            f"{name}: first loss {'EQUAL' if same else 'DIFFERENT'} within {args.rtol:.0%} "
            f"(snakellm {ours[k + 1]:.4f}, Megatron-LM {first})"
        )
        if rc != 0 or first is None:
            print(text[-3000:])
        ok = ok and same
    from snakellm.models.megatron_args import NOT_RECORDED

    print("\nMegatron-LM flags without a counterpart in our checkpoint's args:")
    for k_, why in NOT_RECORDED.items():
        print(f"  {k_}: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
