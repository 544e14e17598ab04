"""What a training job is asked to do, checked before torch is imported (torch-free).

:func:`make_request` turns the parsed ``snakellm train`` arguments into a
:class:`TrainRequest`: the resolved architecture, the blend, the world and its
data-parallel size, the accumulation steps. Everything that can be wrong with
the request (model shape, batch sizes versus the world size, tensor/pipeline
sizes, the blend, a required but missing checkpoint) is an :class:`RequestError`
with the numbers, in milliseconds.

:func:`run_config` is what pretraining fingerprints (only
:data:`snakellm.train.settings.TRAJECTORY_KEYS`, the architecture and the
data); :mod:`snakellm.train.resume` decides from it whether to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm import models
from snakellm.config.settings import from_namespace, option
from snakellm.errors import UsageError
from snakellm.io import checkpoint as ckpt
from snakellm.io.log import plural
from snakellm.launch import distributed as distmod
from snakellm.models import fp8, moe
from snakellm.train.dataset import Blend, check_splits, read_blend
from snakellm.train.resume import check_required, decide_resume, fingerprint
from snakellm.train.settings import TRAJECTORY_KEYS, ParallelSettings, TrainSettings


class RequestError(UsageError, ValueError):
    """A request that cannot run, found before training starts."""


def parse_duration(text: str | float | None) -> float | None:
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
    raise RequestError(f"max time {text!r}: expected seconds, 90m, 2h, HH:MM:SS or D-HH:MM:SS")


@dataclass
class TrainRequest:
    """A checked pretraining request: settings, architecture, data and the world it runs in."""

    args: argparse.Namespace
    train: TrainSettings
    parallel: ParallelSettings
    model: dict[str, Any]
    blend: Blend
    vocab: int  # padded
    dist: distmod.DistEnv
    dp: int
    num_micro: int
    decay_steps: int
    max_time: float | None
    run_dir: Path
    ckpt_dir: Path
    run_name: str
    extra: dict[str, Any] = field(default_factory=dict)


def _check_positive(t: TrainSettings) -> None:
    if t.steps < 1:
        raise RequestError(f"--steps must be >= 1, got {t.steps}")
    for name in ("micro_batch_size", "global_batch_size", "save_interval", "log_interval", "eval_interval"):
        if getattr(t, name) < 1:
            raise RequestError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(t, name)}")
    if t.keep_last < 1:
        raise RequestError(
            f"--keep-last must be >= 1 (the latest checkpoint is what a restart resumes from), got {t.keep_last}"
        )
    if t.eval_iters < 0:
        raise RequestError(f"--eval-iters must be >= 0, got {t.eval_iters}")


def data_parallel_size(world: int, tp: int, pp: int, gbs: int, mbs: int) -> tuple[int, int]:
    """(data-parallel size, accumulation steps), or a RequestError that shows the arithmetic."""
    if world % (tp * pp):
        raise RequestError(
            f"world size {world} is not divisible by tensor parallel size {tp} x pipeline parallel size {pp} "
            f"(= {tp * pp})"
        )
    dp = world // (tp * pp)
    if gbs % (mbs * dp):
        raise RequestError(
            f"global batch size {gbs} is not divisible by micro batch size {mbs} x data-parallel size {dp} "
            f"(= {mbs * dp}; data-parallel size = world size {world} / (tp {tp} x pp {pp})): "
            f"choose a global batch size that is a multiple of {mbs * dp}"
        )
    return dp, gbs // (mbs * dp)


def make_request(args: argparse.Namespace, env: dict[str, str] | None = None) -> TrainRequest:
    """Check ``snakellm train``'s arguments against each other, the blend and the launcher's world."""
    t = from_namespace(TrainSettings, args)
    par = from_namespace(ParallelSettings, args)
    overrides = {k: getattr(args, k) for k in models.MODEL_KEYS if getattr(args, k, None) is not None}
    model = models.resolve(args.preset, overrides)
    _check_positive(t)
    dist = distmod.detect(env)
    models.check_parallel(model, par.tp, par.pp, par.virtual_pp)
    models.check_recompute(model, par.pp, par.virtual_pp, par.recompute, par.recompute_method, par.recompute_num_layers)
    fp8.check_request(t.precision, args.device, model, par.tp)
    why = fp8.all_gather_conflict(par.fp8_all_gather, t.precision, t.fp8_recipe)
    if why:
        raise RequestError(f"--fp8-all-gather {why}")
    why = models.grad_reduce_conflict(par.grad_reduce_dtype, t.precision)
    if why:
        raise RequestError(f"--grad-reduce-dtype {par.grad_reduce_dtype} {why}")
    flags = {f.name: option(f) for f in dataclasses.fields(ParallelSettings)}
    conflict = models.parallel_conflict(vars(par), flags.__getitem__)
    if conflict:
        raise RequestError(f"{flags[conflict[0]]} {conflict[1]}")
    dp, num_micro = data_parallel_size(dist.world_size, par.tp, par.pp, t.global_batch_size, t.micro_batch_size)
    why = moe.check_ep(model, par.ep, dist.world_size, par.tp, par.pp)
    if why:
        raise RequestError(f"--ep {par.ep}: {why}")
    why = moe.check_tp(model, par.tp, par.sequence_parallel, flags.__getitem__)
    if why:
        raise RequestError(why)
    why = models.check_pipeline_batches(par.pp, par.virtual_pp, num_micro)
    if why:
        raise RequestError(f"--global-batch-size {t.global_batch_size}: {why}")
    decay = t.decay_steps if t.decay_steps is not None else t.steps
    if not 0 <= t.warmup_steps <= decay:
        raise RequestError(f"--warmup-steps {t.warmup_steps} must be between 0 and the decay steps {decay}")
    if t.min_lr > t.lr:
        raise RequestError(f"--min-lr {t.min_lr} is above --lr {t.lr}")
    max_time = parse_duration(t.max_time)
    blend = read_blend(args.blend)
    check_splits(blend, t.split, t.eval_iters > 0)
    vocab = models.padded_vocab_size(blend.vocab_size, model, par.tp)
    run_dir = Path(args.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    req = TrainRequest(
        args,
        t,
        par,
        model,
        blend,
        vocab,
        dist,
        dp,
        num_micro,
        decay,
        max_time,
        run_dir,
        ckpt_dir,
        args.run_name or run_dir.name,
    )
    check_required(ckpt_dir, t)  # a required resume is decided here, before anything heavy starts
    return req


def run_config(req: TrainRequest, precision: str) -> dict[str, Any]:
    """The settings that define the training trajectory: fingerprinted and stored with the checkpoints."""
    t = req.train
    skip = ("decay_steps", "precision", "fp8_recipe")
    cfg: dict[str, Any] = {k: getattr(t, k) for k in TRAJECTORY_KEYS if k not in skip}
    cfg.update(fp8.trajectory(precision, t.fp8_recipe))
    cfg.update(
        decay_steps=req.decay_steps,
        model=req.model,
        padded_vocab=req.vocab,
        data=req.blend.fingerprint_items(),
    )
    return cfg


def dry_run(req: TrainRequest, nodes: int | None, per_node: int | None, gpu_gib: float | None) -> list[str]:
    """What ``snakellm train --dry-run`` prints: the checked request, the resume decision, the memory per GPU.

    The precision is what the run would use on GPUs (``--device cpu``: fp32), the
    memory table the one ``snakellm plan`` prints (:func:`snakellm.models.memory.report`).
    """
    from snakellm.models import memory

    t, par, d = req.train, req.parallel, req.dist
    precision = t.precision if t.precision != "auto" else ("fp32" if req.args.device == "cpu" else "bf16")
    ranks = (
        f"{plural(d.world_size, 'rank')} = {plural(nodes or 1, 'node')} x {per_node or 1}"
        if nodes or per_node
        else f"{plural(d.world_size, 'rank')} ({d.launcher})"
    )
    cfg = run_config(req, precision)
    action, it, why = decide_resume(req.ckpt_dir, t, cfg, fingerprint(cfg))
    resume = {
        "resume": f"resumes from {req.ckpt_dir / ckpt.iter_name(it or 0)}",
        "fresh": f"starts fresh in {req.ckpt_dir}",
        "archive": f"moves the checkpoints in {req.ckpt_dir} aside and starts fresh",
    }[action]
    options = [
        o
        for o, on in (
            ("sequence parallel", par.sequence_parallel),
            ("distributed optimizer", par.distributed_optimizer),
            (f"{par.virtual_pp} virtual pipeline stages", par.virtual_pp > 1),
            (f"experts over ep {par.ep}", par.ep > 1),
            (f"recompute {par.recompute}", par.recompute != "none"),
            ("FSDP", par.fsdp),
            ("float8 all-gather", par.fp8_all_gather),
            ("gradients reduced in bf16", par.grad_reduce_dtype == "bf16"),
        )
        if on
    ]
    return [
        "snakellm train --dry-run: the request is valid (nothing started, nothing written)",
        f"run {req.run_name}: {ranks}; tp {par.tp} x pp {par.pp} x dp {req.dp}"
        + (f" ({', '.join(options)})" if options else "")
        + f"; global batch {t.global_batch_size} = micro batch {t.micro_batch_size} x dp {req.dp} x "
        f"{req.num_micro} accumulation steps; {t.steps} steps of {t.global_batch_size * req.model['seq_length']:,} tokens",
        f"  model: {models.describe(req.model, req.vocab)}; {precision}",
        f"  data: {req.blend.path} ({len(req.blend.prefixes)} token file{'s' if len(req.blend.prefixes) != 1 else ''}, "
        f"split {t.split})",
        f"  checkpoints: {resume} ({why})",
        *(
            "  " + line
            for line in memory.report(
                req.model,
                req.vocab,
                tp=par.tp,
                pp=par.pp,
                dp=req.dp,
                micro_batch_size=t.micro_batch_size,
                num_micro_batches=req.num_micro,
                sequence_parallel=par.sequence_parallel,
                distributed_optimizer=par.distributed_optimizer,
                bf16=precision in ("bf16", "fp8"),
                gpu_gib=gpu_gib,
                recompute=par.recompute,
                recompute_method=par.recompute_method,
                recompute_num_layers=par.recompute_num_layers,
                virtual_pp=par.virtual_pp,
                fsdp=par.fsdp,
                grad_reduce_in_fp32=par.grad_reduce_dtype == "fp32",
                ep=par.ep,
            )
        ),
    ]
