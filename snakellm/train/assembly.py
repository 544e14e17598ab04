"""One training assembly: pretraining and every fine-tuning method are recipes run by :func:`run`.

A :class:`Recipe` says what differs between them: the data (train and
validation batches), the loss, the model and which of its parameters train,
what a checkpoint holds of it, the settings that define the trajectory, and
what the job leaves behind when it reaches its last step. Everything else is
this module's, the same code for both:

* the job's world (:func:`open_session`): device checks, process group,
  megatron-core's parallel state, the hang watchdog, the stop policy
  (SIGTERM/SIGUSR1 and ``max_time``: checkpoint, exit 75), one lock per run
  directory;
* the resume policy: the recipe's trajectory settings are fingerprinted and
  compared with the checkpoints' (:mod:`snakellm.train.resume`: resume
  auto|require|never, on_config_change archive|error);
* megatron-core DDP, AdamW with fp32 master weights (sharded over the
  data-parallel ranks on request), the warmup + decay schedule;
* the run's copy of its tokenizer (``RUN_DIR/tokenizer/``, :mod:`snakellm.io.run_tokenizer`);
* the checkpoint manager (model part, optimizer, RNG states and the data
  position, so a SIGKILLed job resumes bit for bit), metrics, validation,
  early stopping and the loop (:class:`snakellm.train.trainer.Trainer`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from snakellm.errors import UsageError
from snakellm.io import checkpoint as ckpt
from snakellm.io import run_tokenizer
from snakellm.io.log import log
from snakellm.launch import distributed as distmod
from snakellm.launch import runtime, watchdog
from snakellm.models.moe import defer_expert_zeroing
from snakellm.train.resume import decide_resume, fingerprint
from snakellm.train.signals import StopPolicy
from snakellm.train.trainer import EXIT_OK, Batch, Intervals, Trainer

LossFn = Callable[[Any, Batch], Any]


class JobError(UsageError, ValueError):
    """A job that cannot run in this world (batch sizes against the data-parallel size)."""


@dataclass(frozen=True, kw_only=True)
class Optim:
    """AdamW and its learning-rate schedule."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    weight_decay: float
    betas: tuple[float, float]
    eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False  # Adam states sharded over the data-parallel ranks
    fsdp: bool = False  # parameters, gradients and Adam states sharded (FSDP2; snakellm.train.fsdp)
    fp8_all_gather: bool = False  # fsdp + fp8: the block linears' weights all-gathered in float8
    grad_reduce_bf16: bool = False  # data-parallel gradients reduced in bf16 (parallel.grad_reduce_dtype)
    overlap_param_gather: bool = False  # distributed: all-gather each bucket before the next forward uses it


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every training job is told, pretraining or fine-tuning (the recipe holds the rest)."""

    prog: str  # "snakellm train": messages and the stop policy's name
    desc: str  # the progress bar's label
    run_name: str
    run_dir: Path  # locked while the job runs; checkpoints in run_dir / "checkpoints"
    device: str
    steps: int
    global_batch_size: int
    micro_batch_size: int
    optim: Optim
    tp: int = 1
    pp: int = 1
    virtual_pp: int = 1  # model chunks per pipeline rank (the interleaved schedule)
    ep: int = 1  # expert-parallel ranks (mixture of experts), within the data-parallel ones
    threads: int | None = None
    seed: int = 1234
    precision: str = "auto"
    resume: str = "auto"
    on_config_change: str = "archive"
    save_interval: int = 1000
    eval_interval: int = 1000
    log_interval: int = 10
    keep_last: int = 1
    async_save: bool = False  # checkpoints written in the background (megatron-core's async torch_dist save)
    patience: int = 0  # early stopping after this many evaluations without improvement (0: never)
    min_delta: float = 0.0
    max_time: float | None = None
    max_time_text: str | None = None
    collective_timeout: float = 600.0
    checkpoints: bool = True
    progress: bool = True
    tensorboard: bool = False
    profile_steps: str | None = None
    peak_tflops: float | None = None
    cpu_tp: bool = False  # tensor parallelism on gloo (pretraining's tests)
    dropout: bool = False
    sequence_parallel: bool = False
    overlap_grad_reduce: bool = True  # on GPUs with more than one data-parallel rank
    tracking: Any = None  # snakellm.config.sections.TrackingSettings: W&B and MLflow (snakellm.tracking)
    params: dict[str, Any] = field(default_factory=dict)  # the step's resolved settings: the trackers' parameters

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass
class Session:
    """The job's world once started: torch, the device, the ranks and their groups."""

    torch: Any
    device: Any
    cuda: bool
    dist: distmod.DistEnv
    precision: str  # bf16 | fp32 | fp8 (bf16 weights, float8 matmuls: snakellm.models.fp8)
    dp: int
    num_micro: int
    stop: StopPolicy
    watchdog: Any = None
    stop_group: Any = None
    lock: Any = None

    @property
    def rank0(self) -> bool:
        return self.dist.is_rank0

    @property
    def bf16(self) -> bool:
        """bf16 weights (fp8 runs too: only their block matmuls are float8)."""
        return self.precision in ("bf16", "fp8")

    def barrier(self) -> None:
        self.torch.distributed.barrier(group=self.stop_group)

    def to_device(self, b: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}

    def log(self, msg: str) -> None:
        log(msg, self.rank0)


@dataclass
class Parts:
    """The recipe's model: what DDP wraps, and what of it trains and is checkpointed."""

    module: Any  # the torch module DDP wraps (a GPTModel, or the base plus adapters)
    config: Any  # its megatron-core TransformerConfig
    gpt: Any  # the GPTModel inside
    seq_length: int
    flops_per_token: float
    state: Callable[[], dict[str, Any]]  # sharded state dict of what checkpoints hold (what trains)
    load_state: Callable[[dict[str, Any]], None]
    # pipeline parallelism: this rank's stage as model chunks (one, or virtual_pp), each wrapped in its own
    # DDP and run by megatron-core's schedule with these two (snakellm.train.pipeline); ``module`` holds them all
    chunks: list[Any] | None = None
    forward: Callable[[Any, Batch], Any] | None = None  # a chunk on a micro-batch
    reduce: Callable[[Any, Batch], Any] | None = None  # the last chunk's output -> the micro-batch's loss
    # the whole model's sharded state dict in the layout of a run without FSDP (FSDP gathers each weight):
    # what a final artifact writes; None: ``gpt.sharded_state_dict()`` is that already
    whole_state: Callable[[], dict[str, Any]] | None = None


@dataclass
class Done:
    """What the recipe gets back after the last step, to write its outputs."""

    session: Session
    parts: Parts
    trainer: Trainer
    manager: ckpt.CheckpointManager
    fingerprint: str
    config: dict[str, Any]
    wall: float
    digests: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


class Recipe(Protocol):
    """What differs between pretraining and the fine-tuning methods."""

    def loss(self, model: Any, batch: Batch) -> Any:
        """The training (and validation) loss of one micro-batch."""
        ...

    def trajectory(self, s: Session) -> dict[str, Any]:
        """The settings (and data) that define the training trajectory: fingerprinted, stored with checkpoints."""
        ...

    def record(self) -> dict[str, Any]:
        """Stored in run_config.json beside the settings without being part of them (tokenizer, blend)."""
        ...

    def build(self, s: Session) -> Parts: ...

    def describe(self, s: Session, parts: Parts) -> str:
        """The job's one-line description in the log."""
        ...

    def train_batches(self, s: Session, start_step: int) -> Iterator[Batch]: ...

    def valid_batches(self, s: Session) -> Callable[[], Iterable[Batch]] | None: ...

    def meta(self) -> dict[str, Any]:
        """Extra metadata saved in every checkpoint's common state."""
        ...

    def finish(self, done: Done) -> None:
        """Outputs after the last step (rank 0 writes; every rank may take part in collectives)."""
        ...


def run(job: Job, recipe: Recipe) -> int:
    """Run ``recipe`` to its last step (EXIT_OK) or to a clean stop (EXIT_STOPPED, 75)."""
    s = open_session(job)
    tracker = None
    try:
        cfg = recipe.trajectory(s)
        fp = fingerprint(cfg)
        # decided under the run directory's lock: a previous attempt still saving cannot change it afterwards
        action, resume_it, why = decide_resume(job.ckpt_dir, job, cfg, fp)
        _prepare_checkpoint_dir(job, s, action, why, fp, cfg, recipe.record())
        _seed(s, job.seed)
        parts = recipe.build(s)
        model, opt, sched = _wrap(job, s, parts)
        s.log(recipe.describe(s, parts))
        holder: dict[str, Any] = {}
        manager = _manager(job, s, parts, opt, sched, fp, recipe, holder)
        early = _early_stopping(job)
        start = _restore(job, s, manager, resume_it, parts, opt, fp, early, holder) if action == "resume" else 0
        s.barrier()
        tracker = _tracker(job, s, fp, cfg, recipe.record(), fresh=start == 0)
        trainer = _trainer(job, s, recipe, parts, model, opt, sched, manager, early, start, tracker)
        holder["trainer"], holder["early"] = trainer, early
        status = trainer.fit()
        if s.watchdog is not None:
            s.watchdog.beat(trainer.step)
        if hasattr(opt, "sync_params"):
            opt.sync_params()
        digests = [model.digest()] * s.dp if job.optim.fsdp else replica_digests(parts.module)
        if len(set(digests)) != 1:
            raise RuntimeError(f"data-parallel replicas hold different weights: {digests}")
        if status == EXIT_OK:
            wall = time.time() - s.stop.started_at
            recipe.finish(Done(s, parts, trainer, manager, fp, cfg, wall, digests))
            s.barrier()
        trainer.metrics.finish("completed" if status == EXIT_OK else "stopped")
        return status
    finally:
        if tracker is not None:
            tracker.close("failed")  # after an error (a finished tracker is not closed twice)
        if s.watchdog is not None:
            s.watchdog.stop()
        runtime.shutdown()


def open_session(job: Job) -> Session:
    """Check the device, start the process group and megatron-core's parallel state, lock the run directory."""
    # the max_time budget starts now, before the imports and the rendezvous it has to pay for
    stop = StopPolicy(max_time=job.max_time, max_time_text=job.max_time_text, prog=job.prog)
    import torch

    cuda = runtime.prepare(torch, job.device, job.tp, job.threads, cpu_tp=job.cpu_tp, dropout=job.dropout)
    if cuda and job.sequence_parallel:
        # megatron-core's advice for sequence parallelism: one hardware queue, so that its all-gathers are
        # scheduled before the GEMMs they overlap with (read when the CUDA context is created, below)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    d = distmod.detect()
    dp, num_micro = _data_parallel(job, d.world_size)
    distmod.export(d)
    device = runtime.pick_device(torch, "cuda" if cuda else "cpu", d.local_rank)
    # the backend's own timeout is the backstop; the watchdog fires first and names the rank
    runtime.init_process_group(torch, d, device, timeout_s=job.collective_timeout + 60)
    rank0 = d.is_rank0
    wd = watchdog.start(
        torch, d, job.collective_timeout, log=lambda m: log(m, rank0), record=job.run_dir / "watchdog.log"
    )
    stop_group = torch.distributed.new_group(backend="gloo") if cuda and d.world_size > 1 else None
    stop.world_size, stop.group = d.world_size, stop_group
    precision = job.precision if job.precision != "auto" else ("bf16" if cuda else "fp32")
    s = Session(torch, device, cuda, d, precision, dp, num_micro, stop, wd, stop_group)
    try:
        runtime.init_model_parallel(job.tp, job.pp, cuda=cuda, vpp=job.virtual_pp, ep=job.ep)
        s.lock = _lock_run_dir(job.run_dir, rank0)
        s.barrier()
    except BaseException:
        if wd is not None:
            wd.stop()
        runtime.shutdown()
        raise
    return s


def _data_parallel(job: Job, world: int) -> tuple[int, int]:
    """(data-parallel size, accumulation steps) of this world, or a JobError with the arithmetic."""
    if world % (job.tp * job.pp):
        raise JobError(f"world size {world} is not divisible by tensor parallel size {job.tp} x pipeline {job.pp}")
    dp = world // (job.tp * job.pp)
    if job.global_batch_size % (job.micro_batch_size * dp):
        raise JobError(
            f"global batch {job.global_batch_size} is not a multiple of micro batch {job.micro_batch_size} x "
            f"data-parallel size {dp}"
        )
    return dp, job.global_batch_size // (job.micro_batch_size * dp)


def _lock_run_dir(run_dir: Path, rank0: bool) -> Any:
    """One training job per run directory: rank 0 holds an exclusive lock on RUN_DIR/.train.lock.

    A requeued or retried attempt can start while ranks of the previous one are
    still finishing their last save (ranks outliving their step, a second
    Snakemake process): two trainers in one checkpoint directory would resave
    and delete each other's checkpoints. The next attempt waits for the lock
    (the kernel drops it when the holder dies), then decides where to resume.
    """
    if not rank0:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    fh = open(run_dir / ".train.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"waiting for another job on {run_dir} to finish (a previous attempt still running?)")
        fcntl.flock(fh, fcntl.LOCK_EX)
        log(f"{run_dir} is free")
    return fh


def _prepare_checkpoint_dir(
    job: Job, s: Session, action: str, why: str, fp: str, cfg: dict[str, Any], record: dict[str, Any]
) -> None:
    """Resume, start fresh, or move old checkpoints aside; a fresh start records the settings."""
    if action == "archive":
        s.barrier()
        if s.rank0:
            dest = ckpt.archive(job.ckpt_dir)
            s.log(f"checkpoints moved aside to {dest} ({why}); starting fresh")
        s.barrier()
    if s.rank0 and record.get("tokenizer"):
        # the run carries the tokenizer it is trained with: every later step reads RUN_DIR/tokenizer/
        run_tokenizer.carry(record["tokenizer"], job.run_dir)
    if action in ("archive", "fresh") and s.rank0:
        job.ckpt_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_run_config(job.ckpt_dir, fp, cfg, **record)
        live = job.ckpt_dir / ckpt.LIVE_METRICS
        if live.exists():
            live.unlink()
    s.barrier()


def _seed(s: Session, seed: int) -> None:
    from megatron.core import tensor_parallel

    from snakellm.train.rng import seed_all

    seed_all(seed)
    if s.cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _wrap(job: Job, s: Session, parts: Parts) -> tuple[Any, Any, Any]:
    """megatron-core DDP around the recipe's module, AdamW over what trains, the schedule."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from snakellm.models import grad_reduce_conflict
    from snakellm.train.optim import DistributedAdamW, MixedPrecisionAdamW
    from snakellm.train.schedule import CosineSchedule

    o = job.optim
    adamw: dict[str, Any] = dict(lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, clip_grad=o.clip_grad)
    sched = CosineSchedule(o.lr, o.min_lr, o.warmup_steps, o.decay_steps, o.decay_style)
    why = grad_reduce_conflict("bf16" if o.grad_reduce_bf16 else "fp32", s.precision)
    if why:  # precision auto, resolved to fp32 on this device
        raise JobError(f"--grad-reduce-dtype bf16 {why}")
    if o.fsdp:
        from snakellm.train import fsdp

        if {id(p) for p in parts.module.parameters()} != {id(p) for p in parts.gpt.parameters()}:
            raise JobError("FSDP shards a GPTModel whose every weight trains (a full fine-tune, pretraining)")
        # the GPTModel (a full fine-tune's module only wraps it): FSDP's units are its layers
        sharded = fsdp.shard(
            parts.gpt, bf16=s.bf16, cuda=s.cuda, fp8_all_gather=o.fp8_all_gather, reduce_bf16=o.grad_reduce_bf16
        )
        # checkpoints hold this rank's slices, in the layout of every other run
        parts.state, parts.load_state = sharded.sharded_state, sharded.load_state
        parts.whole_state = sharded.whole_state
        fopt = fsdp.FSDPAdamW(sharded, **adamw)
        s.log(
            f"FSDP: rank {s.dist.rank} holds {fopt.numel:,} of {sum(p.numel() for p in fopt.params):,} parameters "
            f"(fp32), their gradients and Adam states"
            + ("; the float8 block linears' weights are all-gathered in float8" if o.fp8_all_gather else "")
            + ("; gradients reduced in bf16" if o.grad_reduce_bf16 else "")
        )
        return sharded, fopt, sched
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not o.grad_reduce_bf16,
        overlap_grad_reduce=job.overlap_grad_reduce and s.cuda and s.dp > 1,
        use_distributed_optimizer=o.distributed,
        overlap_param_gather=o.distributed and o.overlap_param_gather and s.dp > 1,
    )
    if parts.chunks is None:
        model = DDP(parts.config, ddp_cfg, parts.module)
        model.broadcast_params()  # identical weights on every data-parallel rank, whatever happened at init
    else:
        # one DDP per pipeline chunk, as Megatron-LM wraps them (one bucket for the chunks after the first)
        ddps = [DDP(parts.config, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(parts.chunks)]
        for d in ddps:
            d.broadcast_params()
        model = ddps[0] if len(ddps) == 1 else s.torch.nn.ModuleList(ddps)
        if o.distributed and len(ddps) > 1:
            raise JobError("distributed_optimizer with virtual_pp > 1 is not supported yet: use virtual_pp 1")
    if ddp_cfg.overlap_grad_reduce:  # its hooks mark buckets ready: grouped experts hand them a placeholder
        for p in model.parameters():
            p.ddp_hook_needs_grad = True
    elif parts.chunks is None:
        defer_expert_zeroing(model)  # the grouped experts write their first gradients: no zeroing of theirs
    if o.grad_reduce_bf16:
        s.log(
            "megatron-core DDP: gradients reduced in bf16 (its gradient buffers are bf16: micro-batches accumulate in bf16)"
        )
    opt: Any
    if o.distributed:
        opt = DistributedAdamW(model, **adamw)
        s.log(
            f"distributed optimizer: rank {s.dist.rank} holds the Adam states of {opt.numel:,} of "
            f"{sum(p.numel() for p in opt.params):,} parameters"
        )
    else:
        opt = MixedPrecisionAdamW(model, **adamw)
    return model, opt, sched


def _manager(
    job: Job, s: Session, parts: Parts, opt: Any, sched: Any, fp: str, recipe: Recipe, holder: dict[str, Any]
) -> ckpt.CheckpointManager:
    """The checkpoint manager: the recipe's model part, the optimizer, the RNG states and the position."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from snakellm.train.rng import rng_states

    def sharded_state(is_loading: bool) -> dict[str, Any]:
        if hasattr(opt, "sync_params"):
            opt.sync_params()  # overlap_param_gather: the weights of the last step, not those before it
        msd = parts.state()
        out = {
            "model": msd,
            "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading),
        }
        # the RNG states are per (pp, tp) rank: a checkpoint of another model-parallel layout has none for
        # this rank (Megatron-LM skips them too); the model and optimizer reshard by their global keys
        if not (is_loading and holder.get("skip_rng")):
            out["rng_state"] = ShardedObject(
                "rng_state",
                [rng_states(s.cuda)],
                (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                replica_id=ps.get_data_parallel_rank(),
            )
        return out

    def common_state(step: int) -> dict[str, Any]:
        gbs, early = job.global_batch_size, holder.get("early")
        lm_args = getattr(recipe, "megatron_args", None)
        return {
            **({"args": _megatron_namespace(lm_args(), job, s, step)} if lm_args else {}),
            "iteration": step,
            "checkpoint_version": 3.0,
            "opt_param_scheduler": sched.state_dict(step),
            "num_floating_point_operations_so_far": step * gbs * parts.seq_length * parts.flops_per_token,
            "snakellm": {
                "fingerprint": fp,
                "consumed_samples": step * gbs,
                "val_loss": holder["trainer"].last_val if "trainer" in holder else None,
                "best": manager.best,
                "run": job.run_name,
                "early_stopping": {"best": early.best, "bad_evals": early.bad_evals} if early else None,
                "layout": {"tp": job.tp, "pp": job.pp},  # model-parallel layout (whose RNG states it holds)
                **recipe.meta(),
            },
        }

    manager = ckpt.CheckpointManager(
        job.ckpt_dir,
        keep_last=job.keep_last,
        sharded_state=sharded_state,
        common_state=common_state,
        rank=s.dist.rank,
        barrier=s.barrier,
        log=s.log,
        async_save=job.async_save,
        save_group=ps.get_data_parallel_group(with_context_parallel=True),
    )
    return manager


def _megatron_namespace(model_args: dict[str, Any], job: Job, s: Session, step: int) -> Any:
    """Megatron-LM's ``args`` (an argparse.Namespace, as it pickles them) for this run at ``step``."""
    import argparse

    return argparse.Namespace(
        **model_args,
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        world_size=s.dist.world_size,
        data_parallel_size=s.dp,
        micro_batch_size=job.micro_batch_size,
        global_batch_size=job.global_batch_size,
        iteration=step,
        consumed_train_samples=step * job.global_batch_size,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        bf16=s.bf16,
        fp16=False,
        seed=job.seed,
        sequence_parallel=job.sequence_parallel,
        use_distributed_optimizer=job.optim.distributed,
        no_save_optim=None,
        no_save_rng=None,
    )


def _early_stopping(job: Job) -> Any:
    from snakellm.train.validator import EarlyStopping

    return EarlyStopping(job.patience or None, job.min_delta)


def _restore(
    job: Job,
    s: Session,
    manager: ckpt.CheckpointManager,
    it: int | None,
    parts: Parts,
    opt: Any,
    fp: str,
    early: Any,
    holder: dict[str, Any],
) -> int:
    """Model part, optimizer, RNG states and stopping state of ``iter_{it}``; returns the step to continue from."""
    from snakellm.train.rng import set_rng_states

    assert it is not None
    t0 = time.time()
    saved = ckpt.load_common(job.ckpt_dir, it).get("snakellm", {}).get("layout") or {"tp": job.tp, "pp": job.pp}
    here = {"tp": job.tp, "pp": job.pp}
    holder["skip_rng"] = saved != here
    if saved != here:
        s.log(
            f"{ckpt.iter_name(it)} was written at tp {saved['tp']} x pp {saved['pp']}, this job runs tp {job.tp} x "
            f"pp {job.pp}: weights and optimizer states reshard; the RNG states start from the seed"
        )
    loaded, common = manager.restore(it)
    meta = common.get("snakellm", {})
    if meta.get("fingerprint") not in (None, fp):
        raise ckpt.CheckpointError(
            f"{ckpt.iter_name(it)} was saved with settings {meta.get('fingerprint')}, "
            f"but {ckpt.RUN_CONFIG} says {fp}: the checkpoint directory was edited by hand"
        )
    parts.load_state(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    if "rng_state" in loaded:
        rng = loaded["rng_state"]
        set_rng_states(rng[0] if isinstance(rng, list) else rng, s.cuda)
    manager.best = meta.get("best") or ckpt.read_best(job.ckpt_dir)
    es = meta.get("early_stopping") or {}
    early.best, early.bad_evals = es.get("best"), int(es.get("bad_evals", 0))
    if s.rank0:
        ckpt.truncate_live_metrics(job.ckpt_dir, it)
        ckpt.mark_resumed(job.ckpt_dir, it)
    s.log(
        f"resumed from {job.ckpt_dir / ckpt.iter_name(it)} (iteration {it}, "
        f"{it * job.global_batch_size} samples consumed; loaded in {time.time() - t0:.1f}s)"
    )
    return it


def _tracker(job: Job, s: Session, fp: str, cfg: dict[str, Any], record: dict[str, Any], *, fresh: bool) -> Any:
    """Rank 0's W&B/MLflow tracker (:mod:`snakellm.tracking`), or None when none is configured.

    Its state (the run ids) lives beside the checkpoints: a resumed job continues the same runs, a fresh
    start (no checkpoint to resume, or old ones moved aside) begins new ones.
    """
    from snakellm import tracking

    if not s.rank0 or not tracking.configured(job.tracking):
        return None
    kind = "finetune" if "finetune" in job.prog else "pretrain"
    params = {
        **job.params,
        "fingerprint": fp,
        "trajectory": cfg,
        **{k: v for k, v in record.items() if isinstance(v, (str, int, float))},
        "world_size": s.dist.world_size,
        "precision": s.precision,
    }
    return tracking.open_tracker(
        job.tracking,
        tracking.RunInfo(name=job.run_name, kind=kind, dir=job.ckpt_dir, files_dir=job.run_dir, params=params),
        fresh=fresh,
    )


def _trainer(
    job: Job,
    s: Session,
    recipe: Recipe,
    parts: Parts,
    model: Any,
    opt: Any,
    sched: Any,
    manager: ckpt.CheckpointManager,
    early: Any,
    start: int,
    tracker: Any = None,
) -> Trainer:
    """Metrics, validation and the loop over the recipe's batches."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from snakellm.train.metrics import MetricsLogger, peak_tflops_of
    from snakellm.train.profiling import StepProfiler, parse_range
    from snakellm.train.validator import Validator

    dp_group, gbs = ps.get_data_parallel_group(), job.global_batch_size
    peak = job.peak_tflops
    if peak is None and s.cuda:
        peak = peak_tflops_of(s.torch.cuda.get_device_name(s.device))
    valid = recipe.valid_batches(s)
    pipeline, val_model = None, model
    if parts.chunks is not None:
        from snakellm.train.pipeline import Pipeline

        assert parts.forward is not None and parts.reduce is not None
        pipeline = Pipeline(
            list(model) if isinstance(model, s.torch.nn.ModuleList) else [model],
            parts.config,
            forward=parts.forward,
            reduce=parts.reduce,
            to_device=s.to_device,
            seq_length=parts.seq_length,
            micro_batch_size=job.micro_batch_size,
        )
        val_model = pipeline
    metrics = MetricsLogger(
        job.ckpt_dir / ckpt.LIVE_METRICS,
        rank0=s.rank0,
        tokens_per_step=gbs * parts.seq_length,
        samples_per_step=gbs,
        flops_per_token=parts.flops_per_token,
        peak_tflops=peak,
        world_size=s.dist.world_size,
        dp_group=dp_group,
        dp_size=s.dp,
        tensorboard_dir=job.run_dir / "tensorboard" if job.tensorboard else None,
        start_step=start,
        router=_router_stats(parts, s.num_micro),
        tracker=tracker,
    )
    return Trainer(
        model=pipeline or model,
        optimizer=opt,
        lr_schedule=sched,
        num_micro=s.num_micro,
        loss_fn=recipe.loss,
        batches=recipe.train_batches(s, start),
        intervals=Intervals(job.steps, job.save_interval, job.eval_interval, job.log_interval, job.checkpoints),
        metrics=metrics,
        stop=s.stop,
        checkpoints=manager,
        validator=Validator(
            val_model,
            valid,
            recipe.loss,
            to_device=s.to_device,
            dp_group=dp_group,
            dp_size=s.dp,
            evaluate=pipeline.evaluate if pipeline is not None else None,
        )
        if valid is not None
        else None,
        early_stop=early if job.patience else None,
        to_device=s.to_device,
        start_step=start,
        overlap_grad_reduce=job.overlap_grad_reduce and s.cuda and s.dp > 1 and not job.optim.fsdp,
        rank0=s.rank0,
        profiler=StepProfiler(parse_range(job.profile_steps), job.run_dir / "profile.txt", s.cuda, s.rank0),
        desc=job.desc,
        show_progress=job.progress,
        heartbeat=s.watchdog.beat if s.watchdog else None,
        finalize_grads=(lambda: finalize_model_grads([model]))
        if job.sequence_parallel and not job.optim.fsdp
        else None,
        forward_backward=pipeline.step if pipeline is not None else None,
    )


def _router_stats(parts: Parts, num_micro: int) -> Any:
    """A mixture of experts' router health per step (snakellm.train.router_stats); None for a dense model."""
    from snakellm.train.router_stats import RouterStats

    cfg = parts.config
    if not getattr(cfg, "num_moe_experts", None):
        return None
    return RouterStats(parts.chunks or [parts.module], cfg.moe_router_topk, num_micro)


def replica_digests(module: Any) -> list[str]:
    """sha256 of this rank's weights, gathered over its data-parallel group (all must be equal)."""
    import torch
    from megatron.core import parallel_state

    def digest(expert: bool) -> str:
        h = hashlib.sha256()
        for name, p in sorted(module.named_parameters()):
            if (not getattr(p, "allreduce", True)) == expert:
                h.update(name.encode())
                h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # a mixture of experts split over expert-parallel ranks: the experts are replicas only over the expert
        # data-parallel ranks (the same experts); the dense weights over all data-parallel ranks
        group = parallel_state.get_expert_data_parallel_group()
        experts: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(experts, digest(True), group=group)
        if len(set(experts)) != 1:
            raise RuntimeError(f"expert data-parallel replicas hold different experts: {experts}")
        mine = digest(False)
    else:  # every weight a replica (a dense model: the digest of all of them, as before experts existed)
        has_experts = any(not getattr(p, "allreduce", True) for p in module.parameters())
        mine = digest(False) + (digest(True) if has_experts else "")
    out: list[Any] = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(out, mine, group=parallel_state.get_data_parallel_group())
    return out


def model_numel(module: Any, tp: int, trainable_only: bool = False) -> int:
    """Parameters of the whole model, not of this rank's shard: a tensor-parallel split counts tp times."""
    return sum(
        p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        for p in module.parameters()
        if p.requires_grad or not trainable_only
    )
