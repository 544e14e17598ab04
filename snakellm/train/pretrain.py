"""Pretraining: a GPT on a blend, assembled from the parts and run by the :class:`Trainer`.

:func:`pretrain` takes a checked :class:`snakellm.train.request.TrainRequest`
and does what is specific to pretraining: decide resume / fresh / archive from
the stored settings, start the process group and megatron-core's parallel
state, build the model (megatron-core DDP) and :class:`MixedPrecisionAdamW` (or,
sharded over the data-parallel ranks, :class:`DistributedAdamW`),
Megatron's blended ``GPTDataset`` for training and validation, restore a
checkpoint (model, optimizer, RNG), then hand everything to the loop and write
``metrics.jsonl`` and ``train_summary.json`` when it reached its last step.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from snakellm import models
from snakellm.io import checkpoint as ckpt
from snakellm.io.atomic import write_json, write_text
from snakellm.io.log import log
from snakellm.launch import distributed as distmod
from snakellm.launch import runtime, watchdog
from snakellm.train import dataset as datamod
from snakellm.train.metrics import MetricsLogger, merge_metrics, peak_tflops_of
from snakellm.train.profiling import StepProfiler, parse_range
from snakellm.train.request import TrainRequest, decide_resume, fingerprint, run_config
from snakellm.train.rng import rng_states, seed_all, set_rng_states
from snakellm.train.signals import StopPolicy
from snakellm.train.trainer import EXIT_OK, Batch, Intervals, Trainer
from snakellm.train.validator import Validator


def lm_loss(model: Any, b: Batch) -> Any:
    """Mean next-token loss over the tokens the loss mask keeps (megatron-core computes it per token)."""
    per_tok = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    mask = b["loss_mask"].to(per_tok.dtype)
    return (per_tok.float() * mask).sum() / mask.sum().clamp(min=1)


def pretrain(req: TrainRequest) -> int:
    """Run the request to its last step (EXIT_OK) or to a clean stop (EXIT_STOPPED)."""
    import time

    a, t, par, d = req.args, req.train, req.parallel, req.dist
    rank0 = d.is_rank0
    stop = StopPolicy(max_time=req.max_time, max_time_text=str(t.max_time))
    import torch

    dropout = bool(req.model["hidden_dropout"] or req.model["attention_dropout"])
    cuda = runtime.prepare(torch, a.device, par.tp, par.threads, cpu_tp=True, dropout=dropout)
    if cuda and par.sequence_parallel:
        # megatron-core's advice for sequence parallelism: one hardware queue, so that its all-gathers are
        # scheduled before the GEMMs they overlap with (read when the CUDA context is created, below)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    precision = t.precision if t.precision != "auto" else ("bf16" if cuda else "fp32")
    cfg = run_config(req, precision)
    fp = fingerprint(cfg)

    distmod.export(d)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from snakellm.models.build import build_model
    from snakellm.train.optim import DistributedAdamW, MixedPrecisionAdamW
    from snakellm.train.schedule import CosineSchedule

    device = runtime.pick_device(torch, "cuda" if cuda else "cpu", d.local_rank)
    # the backend's own timeout is the backstop; the watchdog fires first and names the rank
    runtime.init_process_group(torch, d, device, timeout_s=t.collective_timeout + 60)
    wd = watchdog.start(
        torch, d, t.collective_timeout, log=lambda m: log(m, rank0), record=req.run_dir / "watchdog.log"
    )
    stop_group = torch.distributed.new_group(backend="gloo") if cuda and d.world_size > 1 else None
    stop.world_size, stop.group = d.world_size, stop_group

    def barrier() -> None:
        torch.distributed.barrier(group=stop_group)

    try:
        runtime.init_model_parallel(par.tp, par.pp, cuda=cuda)
        lock = _lock_run_dir(req, rank0)  # noqa: F841  (held until this process exits)
        barrier()
        # decided under the lock: a previous attempt still saving cannot change it afterwards
        action, resume_it, why = decide_resume(req.ckpt_dir, t, cfg, fp)
        _prepare_checkpoint_dir(req, action, why, fp, cfg, rank0, barrier)

        seed_all(t.seed)
        if cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
        module, tcfg = build_model(
            req.model,
            req.vocab,
            tp=par.tp,
            device=str(device),
            bf16=precision == "bf16",
            fused_loss=par.loss,
            compile_layers=par.compile,
            attention_backend=a.attention_backend,
            sequence_parallel=par.sequence_parallel,
        )
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=cuda and req.dp > 1,
            use_distributed_optimizer=par.distributed_optimizer,
        )
        model = DDP(tcfg, ddp_cfg, module)
        model.broadcast_params()  # identical weights on every data-parallel rank, whatever happened at init
        adamw: dict[str, Any] = dict(
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            clip_grad=t.clip_grad,
        )
        opt: MixedPrecisionAdamW | DistributedAdamW
        if par.distributed_optimizer:
            opt = DistributedAdamW(model, **adamw)
            log(
                f"distributed optimizer: rank {d.rank} holds the Adam states of {opt.numel:,} of "
                f"{sum(p.numel() for p in opt.params):,} parameters",
                rank0,
            )
        else:
            opt = MixedPrecisionAdamW(model, **adamw)
        sched = CosineSchedule(t.lr, t.min_lr, t.warmup_steps, req.decay_steps, t.lr_decay_style)
        nparams, flops_tok = _count(req, module, rank0)
        peak = (
            a.peak_tflops
            if a.peak_tflops is not None
            else (peak_tflops_of(torch.cuda.get_device_name(device)) if cuda else None)
        )
        log(
            f"run {req.run_name}: {models.describe(req.model, req.vocab)}; {precision} on "
            f"{'GPU' if cuda else 'CPU'}; world {d.world_size} ({d.launcher}) = dp {req.dp} x tp {par.tp} x "
            f"pp {par.pp}; global batch {t.global_batch_size} = micro {t.micro_batch_size} x dp {req.dp} x "
            f"{req.num_micro} accumulation steps; {t.steps} steps"
            + ("; sequence parallel" if par.sequence_parallel else "")
            + (f"; optimizer sharded over {req.dp} data-parallel ranks" if par.distributed_optimizer else ""),
            rank0,
        )

        seq, gbs, mbs = req.model["seq_length"], t.global_batch_size, t.micro_batch_size
        train_ds, valid_ds = datamod.build_datasets(
            req.blend,
            seq_length=seq,
            seed=t.seed,
            split=t.split,
            train_samples=t.steps * gbs,
            valid_samples=t.eval_iters * gbs,
            cache_dir=str(req.run_dir / "data_cache"),
        )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank()

        def sharded_state(is_loading: bool) -> dict[str, Any]:
            msd = module.sharded_state_dict()
            return {
                "model": msd,
                "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading),
                "rng_state": ShardedObject(
                    "rng_state",
                    [rng_states(cuda)],
                    (
                        parallel_state.get_pipeline_model_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_world_size(),
                    ),
                    (pp_rank, tp_rank),
                    replica_id=dp_rank,
                ),
            }

        def common_state(step: int) -> dict[str, Any]:
            return {
                "iteration": step,
                "checkpoint_version": 3.0,
                "opt_param_scheduler": sched.state_dict(step),
                "num_floating_point_operations_so_far": step * gbs * seq * flops_tok,
                "snakellm": {
                    "fingerprint": fp,
                    "consumed_samples": step * gbs,
                    "val_loss": trainer.last_val,
                    "best": manager.best,
                    "run": req.run_name,
                },
            }

        manager = ckpt.CheckpointManager(
            req.ckpt_dir,
            keep_last=t.keep_last,
            sharded_state=sharded_state,
            common_state=common_state,
            rank=d.rank,
            barrier=barrier,
            log=lambda m: log(m, rank0),
        )
        start_it = 0
        if action == "resume":
            assert resume_it is not None
            start_it = _restore(req, manager, resume_it, module, opt, fp, cuda, rank0)
        barrier()

        def to_dev(b: Batch) -> Batch:
            return {k: v.to(device, non_blocking=True) for k, v in b.items()}

        num_workers = par.num_workers if par.num_workers is not None else (2 if cuda else 0)
        dp_group = parallel_state.get_data_parallel_group()
        validator = None
        if valid_ds is not None and t.eval_iters:
            validator = Validator(
                model,
                lambda: datamod.micro_batches(
                    valid_ds, 0, t.eval_iters, gbs=gbs, mbs=mbs, dp_rank=dp_rank, dp_size=req.dp, num_workers=0
                ),
                lm_loss,
                to_device=to_dev,
                dp_group=dp_group,
                dp_size=req.dp,
            )
        metrics = MetricsLogger(
            req.ckpt_dir / ckpt.LIVE_METRICS,
            rank0=rank0,
            tokens_per_step=gbs * seq,
            samples_per_step=gbs,
            flops_per_token=flops_tok,
            peak_tflops=peak,
            world_size=d.world_size,
            dp_group=dp_group,
            dp_size=req.dp,
            tensorboard_dir=req.run_dir / "tensorboard" if a.tensorboard else None,
            start_step=start_it,
        )
        trainer = Trainer(
            model=model,
            optimizer=opt,
            lr_schedule=sched,
            num_micro=req.num_micro,
            loss_fn=lm_loss,
            batches=datamod.micro_batches(
                train_ds,
                start_it,
                t.steps,
                gbs=gbs,
                mbs=mbs,
                dp_rank=dp_rank,
                dp_size=req.dp,
                num_workers=num_workers,
                pin_memory=cuda,
            ),
            intervals=Intervals(t.steps, t.save_interval, t.eval_interval, t.log_interval, a.checkpoints),
            metrics=metrics,
            stop=stop,
            checkpoints=manager,
            validator=validator,
            to_device=to_dev,
            start_step=start_it,
            overlap_grad_reduce=ddp_cfg.overlap_grad_reduce,
            rank0=rank0,
            profiler=StepProfiler(parse_range(a.profile_steps), req.run_dir / "profile.txt", cuda, rank0),
            desc=f"train {req.run_name}",
            show_progress=a.progress,
            heartbeat=wd.beat if wd else None,
            finalize_grads=(lambda: finalize_model_grads([model])) if par.sequence_parallel else None,
        )
        status = trainer.fit()

        if wd is not None:
            wd.beat(trainer.step)
        digests = replica_digests(module)
        if len(set(digests)) != 1:
            raise RuntimeError(f"data-parallel replicas hold different weights: {digests}")
        if status == EXIT_OK:
            if rank0:
                peak = torch.cuda.max_memory_allocated(device) if cuda else None
                write_summary(
                    req, fp, manager.best, nparams, flops_tok, time.time() - stop.started_at, precision, digests, peak
                )
            barrier()
        return status
    finally:
        if wd is not None:
            wd.stop()
        runtime.shutdown()


def _lock_run_dir(req: TrainRequest, rank0: bool) -> Any:
    """One training job per run directory: rank 0 holds an exclusive lock on RUN_DIR/.train.lock.

    A requeued or retried attempt can start while ranks of the previous one are
    still finishing their last save (ranks outliving their step, a second
    Snakemake process): two trainers in one checkpoint directory would resave
    and delete each other's checkpoints. The next attempt waits for the lock
    (the kernel drops it when the holder dies), then decides where to resume.
    """
    if not rank0:
        return None
    import fcntl

    req.run_dir.mkdir(parents=True, exist_ok=True)
    fh = open(req.run_dir / ".train.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"waiting for another snakellm train on {req.run_dir} to finish (a previous attempt still running?)")
        fcntl.flock(fh, fcntl.LOCK_EX)
        log(f"{req.run_dir} is free")
    return fh


def _prepare_checkpoint_dir(
    req: TrainRequest, action: str, why: str, fp: str, cfg: dict[str, Any], rank0: bool, barrier: Any
) -> None:
    """Resume, start fresh, or move old checkpoints aside; a fresh start records the settings."""
    if action == "archive":
        barrier()
        if rank0:
            dest = ckpt.archive(req.ckpt_dir)
            log(f"checkpoints moved aside to {dest} ({why}); starting fresh", rank0)
        barrier()
    if action in ("archive", "fresh") and rank0:
        req.ckpt_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_run_config(req.ckpt_dir, fp, cfg, tokenizer=req.blend.tokenizer, blend=req.blend.path)
        live = req.ckpt_dir / ckpt.LIVE_METRICS
        if live.exists():
            live.unlink()
    barrier()


def _count(req: TrainRequest, module: Any, rank0: bool) -> tuple[int, float]:
    """Parameters and FLOPs per token from the shapes; the formula behind MFU is checked against the model."""
    nparams = models.param_count(req.model, req.vocab)
    if req.parallel.tp == 1:
        built = sum(p.numel() for p in module.parameters())
        req.extra["model_parameters"] = built
        if built != nparams:
            log(f"warning: the model has {built} parameters, the MFU formula counts {nparams}", rank0)
    return nparams, models.flops_per_token(req.model, req.vocab)


def _restore(
    req: TrainRequest, manager: ckpt.CheckpointManager, it: int, module: Any, opt: Any, fp: str, cuda: bool, rank0: bool
) -> int:
    """Model, optimizer and RNG states of ``iter_{it}``; returns the step to continue from."""
    loaded, common = manager.restore(it)
    meta = common.get("snakellm", {})
    if meta.get("fingerprint") not in (None, fp):
        raise ckpt.CheckpointError(
            f"{ckpt.iter_name(it)} was saved with settings {meta.get('fingerprint')}, "
            f"but {ckpt.RUN_CONFIG} says {fp}: the checkpoint directory was edited by hand"
        )
    module.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    rng = loaded["rng_state"]
    set_rng_states(rng[0] if isinstance(rng, list) else rng, cuda)
    manager.best = meta.get("best")
    if rank0:
        ckpt.truncate_live_metrics(req.ckpt_dir, it)
        ckpt.mark_resumed(req.ckpt_dir, it)
    log(
        f"resumed from {req.ckpt_dir / ckpt.iter_name(it)} (iteration {it}, "
        f"{it * req.train.global_batch_size} samples consumed)",
        rank0,
    )
    return it


def replica_digests(module: Any) -> list[str]:
    """sha256 of this rank's weights, gathered over its data-parallel group (all must be equal)."""
    import torch
    from megatron.core import parallel_state

    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    out: list[Any] = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(out, h.hexdigest()[:16], group=parallel_state.get_data_parallel_group())
    return out


def write_summary(
    req: TrainRequest,
    fp: str,
    best: dict[str, Any] | None,
    nparams: int,
    flops_tok: float,
    wall: float,
    precision: str,
    digests: list[str],
    peak_memory: int | None = None,
) -> None:
    """``metrics.jsonl`` (one record per step) and ``train_summary.json``: the rule's declared outputs."""
    import json

    a, t = req.args, req.train
    recs = merge_metrics(req.ckpt_dir / ckpt.LIVE_METRICS)
    write_text(req.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
    train_recs = [r for r in recs if "loss" in r]
    vals = [r for r in recs if r.get("val_loss") is not None]
    tail = train_recs[-min(10, len(train_recs)) :] if train_recs else []
    tps = [r["tokens_per_s"] for r in train_recs if r.get("tokens_per_s")]
    summary = {
        "run": req.run_name,
        "status": "completed",
        "iteration": t.steps,
        "checkpoint": str(req.ckpt_dir / ckpt.iter_name(t.steps)) if a.checkpoints else None,
        "checkpoint_dir": str(req.ckpt_dir),
        "best": best,
        "fingerprint": fp,
        "model": req.model,
        "params": nparams,
        "model_parameters": req.extra.get("model_parameters"),
        "padded_vocab_size": req.vocab,
        "precision": precision,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "world_size": req.dist.world_size,
        "tokens": t.steps * t.global_batch_size * req.model["seq_length"],
        "first_loss": train_recs[0]["loss"] if train_recs else None,
        "final_loss": sum(r["loss"] for r in tail) / len(tail) if tail else None,
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "flops_per_token": flops_tok,
        "last_session_wall_s": round(wall, 3),
        "blend": req.blend.path,
        "tokenizer": req.blend.tokenizer,
        "replica_weight_digests": digests,
        # torch's allocator peak on rank 0's GPU (what snakellm.models.memory estimates, minus the CUDA context)
        "peak_gpu_memory_gib": round(peak_memory / 2**30, 3) if peak_memory is not None else None,
    }
    write_json(req.run_dir / "train_summary.json", summary)
