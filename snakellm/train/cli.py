"""``snakellm train``: pretrain a GPT on a blend with megatron-core, resumably.

One command for every launch: alone (CPU or one GPU), under ``torchrun``, under
``srun`` or ``mpirun``; ranks come from the environment (snakellm.distributed).
Everything that can be wrong with the request (model shape, batch sizes versus
the world size, tensor/pipeline sizes, the blend, a required but missing
checkpoint) is checked before torch is imported and reported with the numbers.

Checkpoints (snakellm.checkpoint) are Megatron-LM's ``iter_{N:07d}/`` +
``latest_checkpointed_iteration.txt`` with model, optimizer, scheduler, RNG
states and the data position (the iteration: see snakellm.data). A restarted
run resumes from the latest checkpoint and continues exactly where an
uninterrupted run would be. The run's settings are stored with the
checkpoints; after an incompatible change (another model, data, batch size,
schedule...) the old checkpoints are moved aside or the run fails, as
``--on-config-change`` says, never silently reused.

Exit status:

  0   the run reached --steps (final checkpoint, metrics.jsonl, train_summary.json written)
  1   an error during training
  2   a usage or configuration error, found before training started
  75  stopped early on SIGTERM/SIGUSR1 or --max-time, after saving a checkpoint:
      run the same command again (retry / requeue) to continue
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm.train import checkpoint as ckpt
from snakellm.launch import distributed as distmod
from snakellm.models import architecture as models
from snakellm.io.atomic import write_json, write_text
from snakellm.train.dataset import DataError, check_splits, read_blend

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75

# Settings whose change makes old checkpoints a different training run.
# Everything else (intervals, keep_last, max_time, workers, logging) may change between restarts.
_TRAJECTORY_KEYS = (
    "global_batch_size", "lr", "min_lr", "warmup_steps", "decay_steps", "lr_decay_style", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed", "split", "precision",
)

# Peak dense bf16 tensor FLOP/s per GPU, for MFU (override with --peak-tflops).
_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0,
                "L40S": 362.0, "B200": 2250.0}


class PlanError(ValueError):
    """A request that cannot run, found before training starts."""


def parse_duration(text: str | None) -> float | None:
    """Seconds from ``3600``, ``90m``, ``2h``, ``HH:MM:SS`` or Slurm's ``D-HH:MM:SS``."""
    if text in (None, "", "none", "null"):
        return None
    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", s)
    if m:
        return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{2})(?::(\d{2}))?", s)
    if m:
        d, a, b, c = m.groups()
        h, mi, se = (int(a), int(b), int(c)) if c is not None else (0, int(a), int(b))
        return (int(d or 0) * 24 + h) * 3600 + mi * 60 + se
    raise PlanError(f"max time {text!r}: expected seconds, 90m, 2h, HH:MM:SS or D-HH:MM:SS")


# ----------------------------------------------------------------------------- the command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snakellm train",
        description=(
            "Pretrain a GPT with megatron-core on a tokenizer's blend.json, resumably. Ranks come from the "
            "environment (torchrun, srun or mpirun); checkpoints go to RUN_DIR/checkpoints/iter_{N:07d}/ as "
            "Megatron-LM writes them, metrics to RUN_DIR/metrics.jsonl and TensorBoard to RUN_DIR/tensorboard/."
        ),
        epilog=(
            "exit status: 0 done; 1 training error; 2 usage/configuration error (found before training); "
            "75 stopped on SIGTERM/SIGUSR1/--max-time after saving a checkpoint: rerun to resume."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--blend", required=True, help="blend.json of the tokenized data (data_prefix + tokenizer)")
    p.add_argument("--run-dir", required=True, help="output directory of the run (runs/NAME)")
    p.add_argument("--run-name", default=None, help="name for logs and the summary (default: RUN_DIR's name)")

    g = p.add_argument_group("model (a preset, then any single key overridden)")
    g.add_argument("--preset", default=None, choices=sorted(models.PRESETS), help="named model preset")
    g.add_argument("--style", choices=models.STYLES, help="gpt2: learned positions, LayerNorm, GeLU, tied "
                   "embeddings; llama: RoPE, RMSNorm, SwiGLU, GQA, untied")
    for key, typ in (("num_layers", int), ("hidden_size", int), ("num_attention_heads", int),
                     ("num_query_groups", int), ("ffn_hidden_size", int), ("seq_length", int),
                     ("rotary_base", int), ("layernorm_epsilon", float), ("init_method_std", float),
                     ("hidden_dropout", float), ("attention_dropout", float),
                     ("make_vocab_size_divisible_by", int)):
        g.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None)
    g.add_argument("--position-embedding", dest="position_embedding", choices=("learned", "rope"))
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--activation", choices=("gelu", "swiglu"))
    g.add_argument("--tie-embeddings", dest="tie_embeddings", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--bias", dest="bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases in linear layers")

    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, required=True, help="optimizer steps (iterations) in total")
    t.add_argument("--micro-batch-size", type=int, required=True, help="sequences per rank per forward pass")
    t.add_argument("--global-batch-size", type=int, required=True,
                   help="sequences per step: micro batch x data-parallel size x gradient accumulation steps")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=6e-5, help="learning rate at the end of the decay")
    t.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps")
    t.add_argument("--decay-steps", type=int, default=None, help="step at which min-lr is reached (default: --steps)")
    t.add_argument("--lr-decay-style", default="cosine", choices=("cosine", "linear", "constant"))
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.95)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0, help="gradient norm clip (0: off)")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--split", default="969,30,1", help="train,valid,test shares of each token file's documents")
    t.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="auto: bf16 on GPU (fp32 master weights), fp32 on CPU")

    c = p.add_argument_group("checkpoints, evaluation, stopping")
    c.add_argument("--save-interval", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    c.add_argument("--keep-last", type=int, default=2, help="keep the newest K checkpoints (plus the best)")
    c.add_argument("--eval-interval", type=int, default=1000, help="validation loss every N steps (and at each save)")
    c.add_argument("--eval-iters", type=int, default=10, help="validation batches per evaluation (0: no validation)")
    c.add_argument("--log-interval", type=int, default=10, help="fetch and write metrics every N steps")
    c.add_argument("--max-time", default=None,
                   help="stop cleanly (checkpoint, exit 75) after this long: seconds, 90m, 2h, HH:MM:SS, D-HH:MM:SS")
    c.add_argument("--resume", default="auto", choices=("auto", "require", "never"),
                   help="auto: continue from the latest checkpoint if there is one; require: fail if there is "
                   "none; never: move existing checkpoints aside and start fresh")
    c.add_argument("--on-config-change", default="error", choices=("error", "archive"),
                   help="when the checkpoints were made with other settings: fail (error), or move them to "
                   "checkpoints.old-<time>/ and start fresh (archive)")

    s = p.add_argument_group("parallelism and speed")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPU only)")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (must be 1)")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--collective-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a rank that makes no progress this long ends the job, naming the rank(s) it waits for "
                   "(snakellm.launch.watchdog); also the process group's timeout")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU (default: torch's)")
    s.add_argument("--num-workers", type=int, default=None, help="data loader workers (default: 2 on GPU, 0 on CPU)")
    s.add_argument("--loss", dest="loss_impl", default="auto", choices=("auto", "compiled", "eager", "megatron"),
                   help="cross-entropy: compiled (fused, GPU default), eager, or megatron's vocab-parallel one (TP>1)")
    s.add_argument("--attention-backend", default="auto", choices=models.ATTENTION_BACKENDS,
                   help="scaled_dot_product_attention kernel (auto: torch's choice)")
    s.add_argument("--compile", dest="compile_layers", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile each transformer layer")
    s.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: from the GPU name)")

    o = p.add_argument_group("output")
    o.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--no-checkpoints", dest="checkpoints", action="store_false",
                   help="save no checkpoints at all (benchmarks only: nothing to resume from)")
    o.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="torch.profiler over steps A..B; the kernel table goes to RUN_DIR/profile.txt")
    return p


# ----------------------------------------------------------------------------- the plan (no torch)


@dataclass
class Plan:
    args: argparse.Namespace
    model: dict[str, Any]
    blend: Any
    vocab: int  # padded
    dist: distmod.DistEnv
    dp: int
    num_micro: int
    decay_steps: int
    max_time: float | None
    run_dir: Path
    ckpt_dir: Path
    run_name: str
    extra: dict = field(default_factory=dict)


def make_plan(args: argparse.Namespace, env=None) -> Plan:
    a = args
    overrides = {k: getattr(a, k) for k in models.MODEL_KEYS if getattr(a, k, None) is not None}
    model = models.resolve(a.preset, overrides)
    if a.steps < 1:
        raise PlanError(f"--steps must be >= 1, got {a.steps}")
    for name in ("micro_batch_size", "global_batch_size", "save_interval", "log_interval", "eval_interval"):
        if getattr(a, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.keep_last < 1:
        raise PlanError(f"--keep-last must be >= 1 (the latest checkpoint is what a restart resumes from), got {a.keep_last}")
    if a.eval_iters < 0:
        raise PlanError(f"--eval-iters must be >= 0, got {a.eval_iters}")
    dist = distmod.detect(env)
    tp, pp, world = a.tp, a.pp, dist.world_size
    models.check_parallel(model, tp, pp)
    if world % (tp * pp):
        raise PlanError(
            f"world size {world} is not divisible by tensor parallel size {tp} x pipeline parallel size {pp} "
            f"(= {tp * pp})"
        )
    dp = world // (tp * pp)
    gbs, mbs = a.global_batch_size, a.micro_batch_size
    if gbs % (mbs * dp):
        raise PlanError(
            f"global batch size {gbs} is not divisible by micro batch size {mbs} x data-parallel size {dp} "
            f"(= {mbs * dp}; data-parallel size = world size {world} / (tp {tp} x pp {pp})): "
            f"choose a global batch size that is a multiple of {mbs * dp}"
        )
    decay = a.decay_steps if a.decay_steps is not None else a.steps
    if not 0 <= a.warmup_steps <= decay:
        raise PlanError(f"--warmup-steps {a.warmup_steps} must be between 0 and the decay steps {decay}")
    if a.min_lr > a.lr:
        raise PlanError(f"--min-lr {a.min_lr} is above --lr {a.lr}")
    max_time = parse_duration(a.max_time)
    blend = read_blend(a.blend)
    check_splits(blend, a.split, a.eval_iters > 0)
    vocab = models.padded_vocab_size(blend.vocab_size, model, tp)
    run_dir = Path(a.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    plan = Plan(a, model, blend, vocab, dist, dp, gbs // (mbs * dp), decay, max_time, run_dir, ckpt_dir,
                a.run_name or run_dir.name)
    # a required resume is decided here, before anything heavy starts
    if a.resume == "require":
        latest = ckpt.latest_iteration(ckpt_dir)
        if latest is None:
            raise PlanError(
                f"--resume require: no checkpoint to resume from in {ckpt_dir} "
                f"({'directory missing' if not ckpt_dir.exists() else 'no ' + ckpt.TRACKER})"
            )
    else:
        ckpt.latest_iteration(ckpt_dir)  # inconsistent checkpoint directories are errors in every mode
    return plan


def run_config(plan: Plan, precision: str) -> dict:
    a = plan.args
    cfg = {k: getattr(a, k) for k in _TRAJECTORY_KEYS if k not in ("decay_steps", "precision")}
    cfg.update(decay_steps=plan.decay_steps, precision=precision, model=plan.model, padded_vocab=plan.vocab,
               data=plan.blend.fingerprint_items())
    return cfg


def fingerprint(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        o, n = old.get(k, "<unset>"), new.get(k, "<unset>")
        if isinstance(o, dict) and isinstance(n, dict):
            out += _diff(o, n, f"{prefix}{k}.")
        elif o != n:
            out.append(f"{prefix}{k}: {o!r} -> {n!r}")
    return out


def decide_resume(plan: Plan, cfg: dict, fp: str) -> tuple[str, int | None, str]:
    """("resume", iteration, why) | ("fresh", None, why) | ("archive", None, why); raises PlanError to refuse."""
    a = plan.args
    latest = ckpt.latest_iteration(plan.ckpt_dir)
    if a.resume == "never":
        return ("archive" if ckpt.list_iterations(plan.ckpt_dir) else "fresh"), None, "--resume never"
    if latest is None:
        if a.resume == "require":
            raise PlanError(f"--resume require: no checkpoint to resume from in {plan.ckpt_dir}")
        # nothing saved yet (a run stopped before its first checkpoint): its run_config.json and
        # live metrics are simply rewritten
        return "fresh", None, "no checkpoint yet"
    stored = ckpt.read_run_config(plan.ckpt_dir)
    problems = []
    if stored is None:
        problems.append(f"{plan.ckpt_dir / ckpt.RUN_CONFIG} is missing, so the checkpoints' settings are unknown")
    elif stored.get("fingerprint") != fp:
        problems += _diff(stored.get("config", {}), cfg) or ["settings fingerprint differs"]
    if latest > a.steps:
        problems.append(f"the latest checkpoint is at iteration {latest}, past --steps {a.steps}")
    if not problems:
        return "resume", latest, f"latest checkpoint {ckpt.iter_name(latest)}"
    what = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
    if a.resume == "require" or a.on_config_change == "error":
        raise PlanError(
            f"the checkpoints in {plan.ckpt_dir} (latest iteration {latest}) were made with other settings: {what}. "
            "Restore the settings to resume, or start fresh with --on-config-change archive "
            "(config: train.on_config_change: archive), which moves the old checkpoints aside"
        )
    return "archive", None, f"settings changed: {what}"


# ----------------------------------------------------------------------------- training (torch)


class _StopFlag:
    """Set by SIGTERM/SIGUSR1 (what Slurm sends before a time limit); checked between steps."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signal: str | None = None

    def install(self) -> None:
        """From the first training step on; before it a signal simply ends the process (nothing to save)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            print(f"snakellm train: received {self.signal}: saving a checkpoint after this step, then exiting "
                  f"with status {EXIT_STOPPED} (send it again to exit at once)", file=sys.stderr, flush=True)
        else:  # a second signal: the default action (terminate) from now on
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _log(msg: str, rank0: bool) -> None:
    if rank0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _install_cpu_shims(torch) -> None:
    """megatron-core asks torch.cuda for the current device in places that also work on the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None


def _rng_states(torch, tensor_parallel, cuda: bool) -> dict:
    import numpy as np

    st = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if cuda:
        st["cuda_rng_state"] = torch.cuda.get_rng_state()
    return st


def _set_rng_states(torch, tensor_parallel, st: dict, cuda: bool) -> None:
    import numpy as np

    random.setstate(st["random_rng_state"])
    np.random.set_state(st["np_rng_state"])
    torch.set_rng_state(st["torch_rng_state"])
    if cuda and "cuda_rng_state" in st:
        torch.cuda.set_rng_state(st["cuda_rng_state"])
    if st.get("rng_tracker_states"):
        tensor_parallel.get_cuda_rng_tracker().set_states(st["rng_tracker_states"])


def train(plan: Plan) -> int:
    a = plan.args
    d = plan.dist
    rank0 = d.is_rank0
    stop = _StopFlag()
    t_start = time.time()

    import torch

    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: no CUDA device is available")
    if not cuda:
        if a.tp != 1:
            raise PlanError(f"tensor parallel size {a.tp} needs GPUs; on the CPU use tp 1")
        _install_cpu_shims(torch)
        if a.threads:
            torch.set_num_threads(a.threads)
    precision = a.precision if a.precision != "auto" else ("bf16" if cuda else "fp32")
    bf16 = precision == "bf16"
    cfg = run_config(plan, precision)
    fp = fingerprint(cfg)
    action, resume_it, why = decide_resume(plan, cfg, fp)

    distmod.export(d)
    import warnings

    # without apex/Transformer Engine megatron-core warns once per module about its fallbacks
    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine|TransformerEngine).*")
    import megatron.core  # noqa: F401  (~3.5 s)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from snakellm.train import dataset as datamod
    from snakellm.train.optim import MixedPrecisionAdamW
    from snakellm.io.progress import progress
    from snakellm.train.schedule import CosineSchedule

    if cuda:
        # one GPU per rank: all of the node's GPUs visible (pick by local rank) or just one
        device = torch.device("cuda", d.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # A single process needs no rendezvous: an in-memory store, so that concurrent
    # single-process runs on one machine never meet on a TCP port.
    store = torch.distributed.HashStore() if d.world_size == 1 else None
    import datetime

    torch.distributed.init_process_group(
        backend="nccl" if cuda else "gloo", rank=d.rank, world_size=d.world_size, store=store,
        # the backend's own timeout is the backstop; the watchdog fires first and names the rank
        timeout=datetime.timedelta(seconds=a.collective_timeout + 60), **({"device_id": device} if cuda else {}),
    )
    wd = _start_watchdog(torch, d, a.collective_timeout)
    stop_group = torch.distributed.new_group(backend="gloo") if cuda and d.world_size > 1 else None
    barrier = (lambda: torch.distributed.barrier(group=stop_group)) if stop_group else torch.distributed.barrier

    try:
        parallel_state.initialize_model_parallel(a.tp, a.pp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank()

        # ---- the checkpoint directory: resume, start fresh, or move old checkpoints aside
        if action == "archive":
            barrier()
            if rank0:
                dest = ckpt.archive(plan.ckpt_dir)
                _log(f"checkpoints moved aside to {dest} ({why}); starting fresh", rank0)
            barrier()
        if action in ("archive", "fresh") and rank0:
            plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_config(plan.ckpt_dir, fp, cfg)
            live = plan.ckpt_dir / ckpt.LIVE_METRICS
            if live.exists():
                live.unlink()
        barrier()

        # ---- seeds, model, optimizer
        random.seed(a.seed)
        import numpy as np

        np.random.seed(a.seed)
        torch.manual_seed(a.seed)
        if cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
        else:
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

        module, tcfg = models.build_model(plan.model, plan.vocab, tp=a.tp, device=str(device), bf16=bf16,
                                          fused_loss=a.loss_impl, compile_layers=a.compile_layers,
                                          attention_backend=a.attention_backend)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=cuda and plan.dp > 1, use_distributed_optimizer=False,
        )
        model = DDP(tcfg, ddp_cfg, module)
        model.broadcast_params()  # identical weights on every data-parallel rank, whatever happened at init
        opt = MixedPrecisionAdamW(model, lr=a.lr, weight_decay=a.weight_decay, betas=(a.adam_beta1, a.adam_beta2),
                                  eps=a.adam_eps, clip_grad=a.clip_grad)
        sched = CosineSchedule(a.lr, a.min_lr, a.warmup_steps, plan.decay_steps, a.lr_decay_style)
        nparams = models.param_count(plan.model, plan.vocab)
        if a.tp == 1:  # the formula behind MFU, checked against the model megatron-core built
            built = sum(p.numel() for p in module.parameters())
            plan.extra["model_parameters"] = built
            if built != nparams:
                _log(f"warning: the model has {built} parameters, the MFU formula counts {nparams}", rank0)
        flops_tok = models.flops_per_token(plan.model, plan.vocab)
        peak = a.peak_tflops
        if peak is None and cuda:
            name = torch.cuda.get_device_name(device)
            peak = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
        _log(f"run {plan.run_name}: {models.describe(plan.model, plan.vocab)}; {precision} on "
             f"{'GPU' if cuda else 'CPU'}; world {d.world_size} ({d.launcher}) = dp {plan.dp} x tp {a.tp} x pp {a.pp}; "
             f"global batch {a.global_batch_size} = micro {a.micro_batch_size} x dp {plan.dp} x "
             f"{plan.num_micro} accumulation steps; {a.steps} steps", rank0)

        # ---- data
        seq = plan.model["seq_length"]
        gbs, mbs = a.global_batch_size, a.micro_batch_size
        train_ds, valid_ds = datamod.build_datasets(
            plan.blend, seq_length=seq, seed=a.seed, split=a.split, train_samples=a.steps * gbs,
            valid_samples=a.eval_iters * gbs, cache_dir=str(plan.run_dir / "data_cache"),
        )

        # ---- checkpoint state
        def sharded_state(is_loading: bool = False) -> dict:
            msd = module.sharded_state_dict()
            return {
                "model": msd,
                "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading),
                "rng_state": ShardedObject(
                    "rng_state", [_rng_states(torch, tensor_parallel, cuda)],
                    (parallel_state.get_pipeline_model_parallel_world_size(),
                     parallel_state.get_tensor_model_parallel_world_size()),
                    (pp_rank, tp_rank), replica_id=dp_rank,
                ),
            }

        best = None  # {"iteration", "val_loss"}
        start_it = 0
        if action == "resume":
            loaded = ckpt.load(plan.ckpt_dir, resume_it, sharded_state(is_loading=True))
            common = ckpt.load_common(plan.ckpt_dir, resume_it)
            meta = common.get("snakellm", {})
            if meta.get("fingerprint") not in (None, fp):
                raise ckpt.CheckpointError(
                    f"{ckpt.iter_name(resume_it)} was saved with settings {meta.get('fingerprint')}, "
                    f"but {ckpt.RUN_CONFIG} says {fp}: the checkpoint directory was edited by hand"
                )
            module.load_state_dict(loaded["model"], strict=True)
            opt.load_state_dict(loaded["optimizer"])
            rng = loaded["rng_state"]
            _set_rng_states(torch, tensor_parallel, rng[0] if isinstance(rng, list) else rng, cuda)
            start_it = int(common["iteration"])
            if start_it != resume_it:
                raise ckpt.CheckpointError(f"{ckpt.iter_name(resume_it)} holds iteration {start_it}")
            best = meta.get("best")
            if rank0:
                ckpt.truncate_live_metrics(plan.ckpt_dir, start_it)
            _log(f"resumed from {plan.ckpt_dir / ckpt.iter_name(start_it)} (iteration {start_it}, "
                 f"{start_it * gbs} samples consumed)", rank0)
        barrier()

        last_val = None

        def save(it: int, val_loss: float | None) -> None:
            nonlocal best
            if val_loss is not None and (best is None or val_loss < best["val_loss"]):
                best = {"iteration": it, "val_loss": val_loss}
            sd = sharded_state()
            sd.update({
                "iteration": it,
                "checkpoint_version": 3.0,
                "opt_param_scheduler": sched.state_dict(it),
                "num_floating_point_operations_so_far": it * gbs * seq * flops_tok,
                "snakellm": {"fingerprint": fp, "consumed_samples": it * gbs, "val_loss": val_loss,
                             "best": best, "run": plan.run_name},
            })
            t0 = time.time()
            path = ckpt.save(plan.ckpt_dir, it, sd, rank=d.rank, barrier=barrier)
            if rank0:
                if best is not None:
                    write_json(plan.ckpt_dir / ckpt.BEST, best)
                gone = ckpt.prune(plan.ckpt_dir, a.keep_last, {best["iteration"]} if best else set())
                _log(f"saved {path} in {time.time() - t0:.1f}s" + (f"; removed {len(gone)} older" if gone else ""), rank0)
            barrier()

        # ---- evaluation
        num_workers = a.num_workers if a.num_workers is not None else (2 if cuda else 0)

        def to_dev(b):
            return {k: v.to(device, non_blocking=True) for k, v in b.items()}

        def micro_loss(b):
            per_tok = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            mask = b["loss_mask"].to(per_tok.dtype)
            return (per_tok.float() * mask).sum() / mask.sum().clamp(min=1)

        def evaluate() -> float | None:
            if valid_ds is None or a.eval_iters == 0:
                return None
            model.eval()
            total = torch.zeros((), device=device)
            with torch.no_grad():
                for b in datamod.micro_batches(valid_ds, 0, a.eval_iters, gbs=gbs, mbs=mbs, dp_rank=dp_rank,
                                               dp_size=plan.dp, num_workers=0):
                    total += micro_loss(to_dev(b))
            model.train()
            total /= a.eval_iters * plan.num_micro
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
            return total.item() / plan.dp

        # ---- the loop
        tb = None
        if rank0 and a.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(log_dir=str(plan.run_dir / "tensorboard"), purge_step=start_it + 1)
        live_path = plan.ckpt_dir / ckpt.LIVE_METRICS
        batches = datamod.micro_batches(train_ds, start_it, a.steps, gbs=gbs, mbs=mbs, dp_rank=dp_rank,
                                        dp_size=plan.dp, num_workers=num_workers, pin_memory=cuda)
        pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []  # (step, lr, loss, grad norm)
        window_t0, window_steps = time.time(), 0
        tokens_per_step = gbs * seq
        last_losses: list[float] = []
        overlap = ddp_cfg.overlap_grad_reduce

        def stop_requested(it: int) -> str | None:
            reason = stop.signal
            if reason is None and plan.max_time is not None and time.time() - t_start >= plan.max_time:
                reason = f"max time {a.max_time}"
            if d.world_size > 1:
                flag = torch.tensor([1.0 if reason else 0.0])  # on the CPU: a gloo group, no GPU sync
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=stop_group)
                if flag.item() and reason is None:
                    reason = "another rank stopped"
            return reason

        def flush() -> None:
            nonlocal window_t0, window_steps, pending
            if not pending:
                return
            losses = torch.stack([p[2] for p in pending])
            norms = torch.stack([p[3] for p in pending])
            torch.distributed.all_reduce(losses, group=parallel_state.get_data_parallel_group())
            losses = (losses / plan.dp).tolist()
            norms = norms.tolist()
            elapsed = max(time.time() - window_t0, 1e-9)
            tps = window_steps * tokens_per_step / elapsed
            mfu = tps * flops_tok / (peak * 1e12 * d.world_size) if peak else None
            bad = [s for (s, *_), l in zip(pending, losses) if not math.isfinite(l)]
            recs = []
            for (s, lr, _, _), l, gn in zip(pending, losses, norms):
                rec = {"step": s, "loss": l, "lr": lr, "grad_norm": gn, "tokens_per_s": tps, "mfu": mfu,
                       "consumed_samples": s * gbs, "tokens": s * tokens_per_step}
                recs.append(rec)
            if rank0:
                with open(live_path, "a") as fh:
                    fh.write("".join(json.dumps(r) + "\n" for r in recs))
                if tb is not None:
                    for r in recs:
                        for k in ("loss", "lr", "grad_norm"):
                            tb.add_scalar(f"train/{k}", r[k], r["step"])
                    tb.add_scalar("perf/tokens_per_s", tps, recs[-1]["step"])
                    if mfu is not None:
                        tb.add_scalar("perf/mfu", mfu, recs[-1]["step"])
                    tb.flush()
            last_losses[:] = losses
            pending = []
            window_t0, window_steps = time.time(), 0
            if bad:
                raise FloatingPointError(f"loss is not finite at step {bad[0]}")

        status = EXIT_OK
        stop.install()
        with progress(total=a.steps, initial=start_it, desc=f"train {plan.run_name}", unit="step",
                      enabled=a.progress) as bar:
            reason = stop_requested(start_it) if start_it < a.steps else None
            if reason:
                _log(f"stopping before the first step ({reason})", rank0)
                status = EXIT_STOPPED
            it = start_it
            prof_range = _parse_range(a.profile_steps)
            prof = None
            while status == EXIT_OK and it < a.steps:
                it += 1
                if wd is not None:
                    wd.beat(it)
                if prof_range and it == prof_range[0]:
                    prof = _start_profiler(torch, cuda)
                lr = sched.lr(it)
                model.zero_grad_buffer()
                total = torch.zeros((), device=device)
                for m in range(plan.num_micro):
                    b = to_dev(next(batches))
                    ctx = model.no_sync() if (overlap and m < plan.num_micro - 1) else contextlib.nullcontext()
                    with ctx:
                        loss = micro_loss(b)
                        (loss / plan.num_micro).backward()
                    total += loss.detach()
                model.finish_grad_sync()
                norm = opt.step(lr)
                pending.append((it, lr, total / plan.num_micro, norm))
                window_steps += 1
                bar.update(1)
                if prof is not None and it == prof_range[1]:
                    _stop_profiler(prof, torch, cuda, plan.run_dir / "profile.txt", rank0, it - prof_range[0] + 1)
                    prof = None

                val: dict[int, float] = {}
                do_save = a.checkpoints and (it % a.save_interval == 0 or it == a.steps)
                if a.eval_iters and (it % a.eval_interval == 0 or do_save):
                    flush()  # keep evaluation out of the throughput window
                    last_val = evaluate()
                    val[it] = last_val
                    window_t0 = time.time()
                    if tb is not None and last_val is not None:
                        tb.add_scalar("val/loss", last_val, it)
                    if rank0 and last_val is not None:
                        with open(live_path, "a") as fh:
                            fh.write(json.dumps({"step": it, "val_loss": last_val}) + "\n")
                if it % a.log_interval == 0 or do_save or it == a.steps:
                    flush()
                    if last_losses:
                        bar.set_postfix(loss=f"{last_losses[-1]:.4f}", refresh=False)
                reason = stop_requested(it) if it < a.steps else None
                if do_save or (reason and a.checkpoints):
                    flush()
                    save(it, val.get(it))
                    window_t0 = time.time()
                if reason:
                    _log(f"stopped at iteration {it} ({reason}); "
                         + ("checkpoint saved; rerun to resume" if a.checkpoints else "--no-checkpoints: nothing saved")
                         + f" (exit status {EXIT_STOPPED})", rank0)
                    status = EXIT_STOPPED
            flush()
        if tb is not None:
            tb.close()

        digests = _replica_digests(torch, module, parallel_state)
        if len(set(digests)) != 1:
            raise RuntimeError(f"data-parallel replicas hold different weights: {digests}")
        if wd is not None:
            wd.beat(it)
        if status == EXIT_OK:
            if rank0:
                _finish(plan, a, fp, best, nparams, flops_tok, time.time() - t_start, precision, digests)
            barrier()
        return status
    finally:
        if wd is not None:
            wd.stop()
        with contextlib.suppress(Exception):
            parallel_state.destroy_model_parallel()
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()


def _start_watchdog(torch, d: distmod.DistEnv, timeout: float):
    """The hang watchdog (snakellm.launch.watchdog) and the rank table, for a world of more than one rank."""
    if d.world_size == 1:
        return None
    import datetime
    import socket

    from snakellm.launch import watchdog

    rows: list = [None] * d.world_size
    torch.distributed.all_gather_object(rows, (d.rank, d.local_rank, d.local_world_size, socket.gethostname()))
    table = distmod.rank_table(rows)
    _log(f"ranks: {table}; rendezvous {d.master_addr}:{d.master_port}", d.is_rank0)
    return watchdog.Watchdog(
        lambda: torch.distributed.TCPStore(d.master_addr, d.master_port, is_master=False,
                                           timeout=datetime.timedelta(seconds=10)),
        d.rank, d.world_size, d.local_rank, timeout)


def _merge_metrics(live: Path) -> list[dict]:
    """The live file's records, one per step (validation records merged into their step)."""
    by_step: dict[int, dict] = {}
    if live.is_file():
        for line in live.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def _parse_range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < int(m.group(1)):
        raise PlanError(f"--profile-steps {text!r}: expected A:B with 1 <= A <= B")
    return int(m.group(1)), int(m.group(2))


def _start_profiler(torch, cuda: bool):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def _stop_profiler(prof, torch, cuda: bool, path: Path, rank0: bool, steps: int) -> None:
    if cuda:
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    if rank0:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90)
        write_text(path, f"torch.profiler over {steps} steps, sorted by {key}\n{table}\n")
        print(table, file=sys.stderr, flush=True)


def _replica_digests(torch, module, parallel_state) -> list[str]:
    """sha256 of this rank's weights, gathered over its data-parallel group (all must be equal)."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    out: list = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(out, h.hexdigest()[:16], group=parallel_state.get_data_parallel_group())
    return out


def _finish(plan: Plan, a, fp: str, best, nparams: int, flops_tok: float, wall: float, precision: str,
            digests: list[str]) -> None:
    recs = _merge_metrics(plan.ckpt_dir / ckpt.LIVE_METRICS)
    write_text(plan.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
    train_recs = [r for r in recs if "loss" in r]
    vals = [r for r in recs if r.get("val_loss") is not None]
    tail = train_recs[-min(10, len(train_recs)):] if train_recs else []
    tps = [r["tokens_per_s"] for r in train_recs if r.get("tokens_per_s")]
    summary = {
        "run": plan.run_name,
        "status": "completed",
        "iteration": a.steps,
        "checkpoint": str(plan.ckpt_dir / ckpt.iter_name(a.steps)) if a.checkpoints else None,
        "checkpoint_dir": str(plan.ckpt_dir),
        "best": best,
        "fingerprint": fp,
        "model": plan.model,
        "params": nparams,
        "model_parameters": plan.extra.get("model_parameters"),
        "padded_vocab_size": plan.vocab,
        "precision": precision,
        "global_batch_size": a.global_batch_size,
        "micro_batch_size": a.micro_batch_size,
        "world_size": plan.dist.world_size,
        "tokens": a.steps * a.global_batch_size * plan.model["seq_length"],
        "first_loss": train_recs[0]["loss"] if train_recs else None,
        "final_loss": sum(r["loss"] for r in tail) / len(tail) if tail else None,
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "flops_per_token": flops_tok,
        "last_session_wall_s": round(wall, 3),
        "blend": plan.blend.path,
        "replica_weight_digests": digests,
    }
    write_json(plan.run_dir / "train_summary.json", summary)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except (PlanError, models.ModelConfigError, DataError, distmod.LaunchError, ckpt.CheckpointError) as e:
        print(f"snakellm train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return train(plan)
    except (PlanError, models.ModelConfigError, DataError, ckpt.CheckpointError) as e:
        print(f"snakellm train: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, PlanError) else EXIT_ERROR
    except FloatingPointError as e:
        print(f"snakellm train: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
