"""Pretraining: the recipe for a GPT on a blend, run by the one training assembly.

:func:`pretrain` takes a checked :class:`snakellm.train.request.TrainRequest`
and hands :mod:`snakellm.train.assembly` (process group, resume policy, DDP,
optimizer, checkpoints, metrics, the loop) what is specific to pretraining:
a freshly initialised model whose every parameter trains, Megatron's blended
``GPTDataset`` for training and validation, the mean token loss, and
``metrics.jsonl`` + ``train_summary.json`` when the run reached its last step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from snakellm import models, tracking
from snakellm.io import checkpoint as ckpt
from snakellm.io.atomic import write_json, write_text
from snakellm.io.log import log
from snakellm.train import assembly
from snakellm.train import dataset as datamod
from snakellm.train.metrics import merge_metrics
from snakellm.train.request import TrainRequest, run_config
from snakellm.train.trainer import Batch


def lm_forward(model: Any, b: Batch) -> Any:
    """The model (or a pipeline stage of it) on a micro-batch: per-token losses [b, s] from the last stage,
    hidden states from the others (which take their input from the previous stage, not the tokens)."""
    return model(b["tokens"], b["position_ids"], None, labels=b["labels"])


def lm_reduce(per_tok: Any, b: Batch) -> Any:
    """Mean next-token loss over the tokens the loss mask keeps (megatron-core computes it per token)."""
    mask = b["loss_mask"].to(per_tok.dtype)
    return (per_tok.float() * mask).sum() / mask.sum().clamp(min=1)


def lm_loss(model: Any, b: Batch) -> Any:
    """Mean next-token loss of a micro-batch."""
    return lm_reduce(lm_forward(model, b), b)


def pretrain(req: TrainRequest) -> int:
    """Run the request to its last step (EXIT_OK) or to a clean stop (EXIT_STOPPED)."""
    return assembly.run(job_of(req), PretrainRecipe(req))


def job_of(req: TrainRequest) -> assembly.Job:
    """The assembly's job from a checked pretraining request."""
    a, t, par = req.args, req.train, req.parallel
    return assembly.Job(
        prog="snakellm train",
        desc=f"train {req.run_name}",
        run_name=req.run_name,
        run_dir=req.run_dir,
        device=a.device,
        steps=t.steps,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        optim=assembly.Optim(
            lr=t.lr,
            min_lr=t.min_lr,
            warmup_steps=t.warmup_steps,
            decay_steps=req.decay_steps,
            decay_style=t.lr_decay_style,
            weight_decay=t.weight_decay,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            clip_grad=t.clip_grad,
            distributed=par.distributed_optimizer,
            fsdp=par.fsdp,
            fp8_all_gather=par.fp8_all_gather,
            grad_reduce_bf16=par.grad_reduce_dtype == "bf16",
            overlap_param_gather=par.overlap_param_gather,
        ),
        tp=par.tp,
        pp=par.pp,
        virtual_pp=par.virtual_pp,
        ep=par.ep,
        threads=par.threads,
        seed=t.seed,
        precision=t.precision,
        resume=t.resume,
        on_config_change=t.on_config_change,
        save_interval=t.save_interval,
        eval_interval=t.eval_interval,
        log_interval=t.log_interval,
        keep_last=t.keep_last,
        async_save=t.async_save,
        max_time=req.max_time,
        max_time_text=str(t.max_time),
        collective_timeout=t.collective_timeout,
        checkpoints=a.checkpoints,
        progress=a.progress,
        tensorboard=a.tensorboard,
        profile_steps=a.profile_steps,
        peak_tflops=a.peak_tflops,
        tracking=tracking.settings_from_args(a),
        params=vars(a),
        cpu_tp=True,
        dropout=bool(req.model["hidden_dropout"] or req.model["attention_dropout"]),
        sequence_parallel=par.sequence_parallel,
    )


class PretrainRecipe:
    """Pretraining: a fresh GPT, every parameter trains, Megatron's blended GPTDataset, the mean token loss."""

    loss = staticmethod(lm_loss)

    def __init__(self, req: TrainRequest):
        self.req = req
        self.valid_ds: Any = None
        self.train_ds: Any = None
        self.nparams = 0

    def trajectory(self, s: assembly.Session) -> dict[str, Any]:
        return run_config(self.req, s.precision)

    def record(self) -> dict[str, Any]:
        return {"tokenizer": self.req.blend.tokenizer, "blend": self.req.blend.path}

    def build(self, s: assembly.Session) -> assembly.Parts:
        from snakellm.models.build import build_model

        req, par, t = self.req, self.req.parallel, self.req.train

        def chunk(vp_stage: int | None) -> tuple[Any, Any]:
            return build_model(
                req.model,
                req.vocab,
                tp=par.tp,
                device=str(s.device),
                bf16=s.bf16,
                fused_loss=par.loss,
                compile_layers=par.compile,
                attention_backend=req.args.attention_backend,
                sequence_parallel=par.sequence_parallel,
                vp_stage=vp_stage,
                recompute=par.recompute,
                recompute_method=par.recompute_method,
                recompute_num_layers=par.recompute_num_layers,
                seed=t.seed,  # the same initial weights at any tp x pp layout
                fp8=t.fp8_recipe if s.precision == "fp8" else None,
                moe_experts=par.moe_experts,
            )

        chunks: list[Any] | None = None
        if par.pp == 1:
            module, tcfg = chunk(None)
        else:  # this rank's pipeline stage: one chunk, or virtual_pp of them (interleaved schedule)
            built = [chunk(v if par.virtual_pp > 1 else None) for v in range(par.virtual_pp)]
            chunks, tcfg = [m for m, _ in built], built[0][1]
            module = s.torch.nn.ModuleList(chunks)
        seq, gbs = req.model["seq_length"], t.global_batch_size
        self.train_ds, self.valid_ds = datamod.build_datasets(
            req.blend,
            seq_length=seq,
            seed=t.seed,
            split=t.split,
            train_samples=t.steps * gbs,
            valid_samples=t.eval_iters * gbs,
            cache_dir=str(req.run_dir / "data_cache"),
        )
        self.nparams = _count(req, module, s.rank0)

        flops = models.flops_per_token(req.model, req.vocab)
        if chunks is None:

            def load_state(sd: dict[str, Any]) -> None:
                module.load_state_dict(sd, strict=True)

            return assembly.Parts(module, tcfg, module, seq, flops, module.sharded_state_dict, load_state)
        # the checkpoint keys are global (layer numbers, the tied embedding's one key): any layout loads them
        parts_chunks = chunks

        def state() -> dict[str, Any]:
            return {f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(parts_chunks)}

        def load_chunks(sd: dict[str, Any]) -> None:
            for i, c in enumerate(parts_chunks):
                c.load_state_dict(sd[f"chunk{i}"], strict=True)

        return assembly.Parts(
            module, tcfg, chunks[0], seq, flops, state, load_chunks, chunks=chunks, forward=lm_forward, reduce=lm_reduce
        )

    def describe(self, s: assembly.Session, parts: assembly.Parts) -> str:
        req, t, par = self.req, self.req.train, self.req.parallel
        return (
            f"run {req.run_name}: {models.describe(req.model, req.vocab)}; {s.precision}"
            + (f" ({t.fp8_recipe})" if s.precision == "fp8" else "")
            + " on "
            f"{'GPU' if s.cuda else 'CPU'}; world {s.dist.world_size} ({s.dist.launcher}) = dp {s.dp} x tp "
            f"{par.tp} x pp {par.pp}; global batch {t.global_batch_size} = micro {t.micro_batch_size} x dp {s.dp} x "
            f"{s.num_micro} accumulation steps; {t.steps} steps"
            + (f"; interleaved schedule over {par.virtual_pp} virtual stages" if par.virtual_pp > 1 else "")
            + ("; sequence parallel" if par.sequence_parallel else "")
            + (f"; recompute {par.recompute}" if par.recompute != "none" else "")
            + (f"; optimizer sharded over {s.dp} data-parallel ranks" if par.distributed_optimizer else "")
            + (f"; parameters, gradients and optimizer sharded over {s.dp} ranks (FSDP2)" if par.fsdp else "")
        )

    def _micro_batches(self, s: assembly.Session, ds: Any, start: int, end: int, **kw: Any) -> Iterator[Batch]:
        from megatron.core import parallel_state

        t = self.req.train
        return datamod.micro_batches(
            ds,
            start,
            end,
            gbs=t.global_batch_size,
            mbs=t.micro_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=s.dp,
            **kw,
        )

    def train_batches(self, s: assembly.Session, start_step: int) -> Iterator[Batch]:
        par = self.req.parallel
        workers = par.num_workers if par.num_workers is not None else (2 if s.cuda else 0)
        return self._micro_batches(
            s, self.train_ds, start_step, self.req.train.steps, num_workers=workers, pin_memory=s.cuda
        )

    def valid_batches(self, s: assembly.Session) -> Callable[[], Iterable[Batch]] | None:
        iters = self.req.train.eval_iters
        if self.valid_ds is None or not iters:
            return None
        return lambda: self._micro_batches(s, self.valid_ds, 0, iters, num_workers=0)

    def meta(self) -> dict[str, Any]:
        return {}

    def megatron_args(self) -> dict[str, Any]:
        """The model's Megatron-LM arguments, saved as the checkpoint's ``args`` (Megatron-LM resumes from them)."""
        from snakellm.models.megatron_args import megatron_lm_args

        return megatron_lm_args(self.req.model, self.req.vocab)

    def finish(self, done: assembly.Done) -> None:
        s = done.session
        peak = s.torch.cuda.max_memory_allocated(s.device) if s.cuda else None
        peaks = [peak]
        if s.cuda and s.dist.world_size > 1:  # every rank's (pipeline stages differ)
            peaks = [None] * s.dist.world_size
            s.torch.distributed.all_gather_object(peaks, peak, group=s.stop_group)
        if s.rank0:
            summary = write_summary(
                self.req,
                done.fingerprint,
                done.manager.best,
                self.nparams,
                done.parts.flops_per_token,
                done.wall,
                s.precision,
                done.digests,
                peak,
                peaks,
            )
            done.trainer.metrics.summary(summary)


def _count(req: TrainRequest, module: Any, rank0: bool) -> int:
    """Parameters from the shapes; the formula behind MFU is checked against the model."""
    nparams = models.param_count(req.model, req.vocab)
    if req.parallel.tp == 1 and req.parallel.pp == 1:
        built = sum(p.numel() for p in module.parameters())
        req.extra["model_parameters"] = built
        if built != nparams:
            log(f"warning: the model has {built} parameters, the MFU formula counts {nparams}", rank0)
    return nparams


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
    peaks: list[int | None] | None = None,
) -> dict[str, Any]:
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
        "peak_gpu_memory_gib_ranks": [round(p / 2**30, 3) for p in peaks if p is not None] if peaks else None,
    }
    write_json(req.run_dir / "train_summary.json", summary)
    return summary
