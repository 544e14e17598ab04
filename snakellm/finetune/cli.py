"""``snakellm finetune``: LoRA, full SFT or p-tuning of a pretrained run, one loop for all three.

The method only decides which parameters train and what the checkpoints hold:

* ``lora``: adapters on megatron-core's linears (snakellm.finetune.lora); base frozen;
  checkpoints and the optimizer hold only the adapters.
* ``full``: every weight trains; checkpoints hold the whole model.
* ``ptuning``: a prompt encoder makes N virtual tokens (snakellm.finetune.ptuning); base frozen.

Everything else is shared: NeMo-style SFT examples with answer-only loss
(snakellm.finetune.dataset), megatron-core DDP over data-parallel ranks (tensor
parallel on GPUs), AdamW with fp32 masters and the warmup + cosine schedule of
pretraining, validation loss every ``--eval-interval`` steps, the best
checkpoint kept, early stopping after ``--patience`` evaluations without an
improvement of ``--min-delta``. Checkpoints are Megatron-LM's
``iter_{N:07d}/`` (dist_checkpointing) with the trainable weights, optimizer,
RNG states and the data position; a killed run (SIGKILL included) resumes
from the latest one exactly: the same losses as an uninterrupted run.
SIGTERM/SIGUSR1 or ``--max-time`` stop after a checkpoint with exit status 75.

Outputs (from the best checkpoint): ``adapter/`` (LoRA: adapter.safetensors +
adapter_config.json), ``prompt/`` (p-tuning: the encoder and the virtual-token
table), ``model/`` (full: a checkpoint directory ``snakellm evaluate`` and the
exporters load like a pretrained run); ``metrics.jsonl`` and
``finetune_summary.json`` last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from snakellm.io import checkpoint as ckpt
from snakellm.io.atomic import write_json, write_text
from snakellm.io.log import log

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75
METHODS = ("lora", "full", "ptuning")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("examples (as NeMo's GPTSFTDataset)")
    g.add_argument("--template", default="{input} {output}", help="prompt template; must end with {output}")
    g.add_argument("--max-seq-length", type=int, default=None, help="tokens per example (default: the model's)")
    g.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=False, help="BOS before the context")
    g.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True, help="EOD after the answer")
    g.add_argument(
        "--answer-only-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="loss on the answer tokens only (the prompt is masked)",
    )
    g.add_argument(
        "--truncation-method",
        default="right",
        choices=("left", "right"),
        help="too long a context loses tokens from its end (right, NeMo's default) or its start (left)",
    )


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (NeMo's peft lora_tuning options)")
    g.add_argument("--lora-rank", type=int, default=32, help="adapter_dim")
    g.add_argument("--lora-alpha", type=float, default=None, help="scale = alpha / rank (default alpha = rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="adapter_dropout")
    g.add_argument(
        "--lora-targets",
        default="linear_qkv",
        help="comma list of linear_qkv, linear_proj, linear_fc1, linear_fc2 (target_modules)",
    )
    g.add_argument(
        "--lora-layers", default=None, help="comma list of 1-based layer numbers (layer_selection; default all)"
    )
    g.add_argument("--lora-column-init", default="xavier", choices=("xavier", "normal", "kaiming", "zero"))
    g.add_argument("--lora-row-init", default="zero", choices=("xavier", "normal", "kaiming", "zero"))
    g.add_argument(
        "--lora-modules-to-save",
        default="",
        help="comma list of base modules trained whole beside the adapters (PEFT's modules_to_save): final_layernorm",
    )
    g = p.add_argument_group("p-tuning")
    g.add_argument("--virtual-tokens", type=int, default=10)
    g.add_argument("--prompt-encoder", default="mlp", choices=("mlp", "lstm"))
    g.add_argument("--prompt-encoder-hidden", type=int, default=2048)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snakellm finetune",
        description="Fine-tune a pretrained run on {input, output} jsonl (prepare-sft) with LoRA, full SFT or "
        "p-tuning: answer-only loss, validation every N steps, best checkpoint kept, early stopping, exact resume.",
        epilog="exit status: 0 done; 1 error; 2 usage error; 75 stopped on a signal/--max-time after a checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base", required=True, help="pretrained run dir, its checkpoints/ or an iter_NNNNNNN/ dir")
    p.add_argument(
        "--blend",
        default=None,
        help="a blend.json whose tokenizer to use (default: the one recorded with the base run)",
    )
    p.add_argument("--data-dir", required=True, help="directory with train.jsonl and validation.jsonl")
    p.add_argument("--out-dir", required=True, help="output directory (runs/RUN/finetune/TASK)")
    p.add_argument("--method", required=True, choices=METHODS)
    add_method_arguments(p)
    add_data_arguments(p)
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pack several examples into each sequence (block-diagonal attention, positions restart)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--global-batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--warmup-steps", type=int, default=0)
    t.add_argument("--lr-decay-style", default="cosine", choices=("cosine", "linear", "constant"))
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.98)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    c = p.add_argument_group("validation, checkpoints, stopping")
    c.add_argument("--eval-interval", type=int, default=50, help="validation loss every N steps (and a checkpoint)")
    c.add_argument("--eval-examples", type=int, default=0, help="validation examples per evaluation (0: all)")
    c.add_argument(
        "--patience", type=int, default=0, help="stop after this many evaluations without improvement (0: never)"
    )
    c.add_argument("--min-delta", type=float, default=0.001, help="improvement that resets the patience")
    c.add_argument(
        "--select",
        default="best",
        choices=("best", "last"),
        help="which checkpoint the artifacts come from: the best validation loss (NeMo's default) or the last",
    )
    c.add_argument("--keep-last", type=int, default=1, help="newest checkpoints kept (the best is always kept)")
    c.add_argument("--max-time", type=float, default=None, help="seconds; then checkpoint and exit 75")
    s = p.add_argument_group("parallelism")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPU)")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--no-checkpoints", dest="checkpoints", action="store_false", help="benchmarks only")
    s.add_argument("--pad-to-max", action="store_true", help="pad every batch to --max-seq-length (benchmarks)")
    return p


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def method_config(a: argparse.Namespace):
    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.ptuning import PTuningConfig

    if a.method == "lora":
        layers = tuple(int(x) for x in a.lora_layers.split(",")) if a.lora_layers else None
        return LoRAConfig(
            rank=a.lora_rank,
            alpha=a.lora_alpha,
            dropout=a.lora_dropout,
            targets=tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()),
            layers=layers,
            column_init=a.lora_column_init,
            row_init=a.lora_row_init,
            seed=a.seed,
            modules_to_save=tuple(m.strip() for m in a.lora_modules_to_save.split(",") if m.strip()),
        )
    if a.method == "ptuning":
        return PTuningConfig(
            virtual_tokens=a.virtual_tokens, encoder=a.prompt_encoder, hidden=a.prompt_encoder_hidden, seed=a.seed
        )
    return None


def attach(rt, gpt, method: str, mcfg, arch: dict):
    """Freeze what must not train and add the method's module; returns (FTModel, extra module or None)."""
    from snakellm.finetune.runtime import make_ft_model

    ft = make_ft_model(rt.torch, gpt)
    if method == "full":
        return ft, None
    for p in gpt.parameters():
        p.requires_grad_(False)
    w = gpt.embedding.word_embeddings.weight
    extra: Any
    if method == "lora":
        from snakellm.finetune.lora import LoRAAdapters

        extra = LoRAAdapters(gpt, mcfg)
        extra.unfreeze_saved()
    else:
        from snakellm.finetune.ptuning import PTuning

        extra = PTuning(gpt, mcfg, arch["hidden_size"], w.dtype, w.device)
    ft.extra = extra
    return ft, extra


def trainable_sharded_state(method: str, ft, extra) -> dict:
    if method == "full":
        return ft.gpt.sharded_state_dict()
    if method == "lora":
        return extra.sharded_state_dict()
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp_rank, dp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    return {
        f"ptuning.{n}": ShardedTensor.from_rank_offsets(f"ptuning.{n}", p, replica_id=(0, tp_rank, dp_rank))
        for n, p in extra.encoder.named_parameters()
    }


def finetune(a: argparse.Namespace) -> int:
    from snakellm.finetune import artifacts, runtime
    from snakellm.finetune import dataset as ds

    out = Path(a.out_dir)
    ckpt_dir = out / "checkpoints"
    mcfg = method_config(a)
    train_path, valid_path = Path(a.data_dir) / "train.jsonl", Path(a.data_dir) / "validation.jsonl"
    for f in (train_path, valid_path):
        if not f.is_file():
            raise ds.SFTFormatError(f"{f}: not found (run snakellm prepare-sft)")
    if a.global_batch_size % a.micro_batch_size:
        raise ds.SFTFormatError(
            f"global batch {a.global_batch_size} is not a multiple of micro batch {a.micro_batch_size}"
        )

    rt = runtime.start(a.device, a.tp, a.threads, a.seed)
    torch = rt.torch
    rank0 = rt.rank == 0
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from snakellm.models import architecture as models
    from snakellm.models import counts
    from snakellm.train.metrics import MetricsLogger, merge_metrics, peak_tflops_of
    from snakellm.train.optim import MixedPrecisionAdamW
    from snakellm.train.rng import rng_states, set_rng_states
    from snakellm.train.schedule import CosineSchedule
    from snakellm.train.signals import StopPolicy
    from snakellm.train.trainer import EXIT_OK as T_OK
    from snakellm.train.trainer import Intervals, Trainer
    from snakellm.train.validator import EarlyStopping, Validator

    try:
        precision = a.precision if a.precision != "auto" else ("bf16" if rt.cuda else "fp32")
        bf16 = precision == "bf16"
        gpt, tcfg, arch, vocab, base_ckpt, tok_info = runtime.load_base(
            rt, a.base, bf16=bf16, seq_length=a.max_seq_length
        )
        seq = a.max_seq_length or arch["seq_length"]
        if a.blend:
            tok_info = json.loads(Path(a.blend).read_text()).get("tokenizer", tok_info)
        tok = runtime.load_tokenizer(tok_info)
        virtual = mcfg.virtual_tokens if a.method == "ptuning" else 0
        enc = ds.Encoder(tok, seq + 1, a.template, a.add_bos, a.add_eos, a.truncation_method, reserved=virtual)
        prefix = [int(tok.eod_id)] * virtual

        def encode(records):
            exs = enc.encode_all(records)
            for e in exs:
                e.context = prefix + e.context
            return exs

        train_ex = encode(ds.read_jsonl(train_path))
        train_stats = enc.stats.as_dict()
        enc.stats = ds.EncodeStats()
        valid_ex = encode(ds.read_jsonl(valid_path))
        if a.eval_examples:
            valid_ex = valid_ex[: a.eval_examples]
        items = [[i] for i in range(len(train_ex))] if not a.packing else ds.pack(train_ex, seq, a.seed)
        dp = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_group = parallel_state.get_data_parallel_group()
        if a.global_batch_size % (a.micro_batch_size * dp):
            raise ds.SFTFormatError(
                f"global batch {a.global_batch_size} is not a multiple of micro batch "
                f"{a.micro_batch_size} x data-parallel size {dp}"
            )
        num_micro = a.global_batch_size // (a.micro_batch_size * dp)

        # ---- settings fingerprint: another trajectory never resumes these checkpoints
        cfg = {
            "method": a.method,
            "method_config": mcfg.as_dict() if mcfg else None,
            "base": str(base_ckpt),
            "model": arch,
            "padded_vocab": vocab,
            "data": {"train": _sha256(train_path), "validation": _sha256(valid_path)},
            "examples": {
                k: getattr(a, k)
                for k in ("template", "add_bos", "add_eos", "answer_only_loss", "truncation_method", "packing")
            }
            | {"seq": seq},
            "train": {
                k: getattr(a, k)
                for k in (
                    "steps",
                    "global_batch_size",
                    "micro_batch_size",
                    "lr",
                    "min_lr",
                    "warmup_steps",
                    "lr_decay_style",
                    "weight_decay",
                    "adam_beta1",
                    "adam_beta2",
                    "clip_grad",
                    "seed",
                )
            }
            | {"precision": precision},
        }
        fp = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
        latest = ckpt.latest_iteration(ckpt_dir)
        if latest is not None:
            stored = ckpt.read_run_config(ckpt_dir) or {}
            if stored.get("fingerprint") != fp or latest > a.steps:
                torch.distributed.barrier()
                if rank0:
                    dest = ckpt.archive(ckpt_dir)
                    log(f"checkpoints made with other settings moved to {dest}; starting fresh")
                latest = None
            torch.distributed.barrier()
        if latest is None and rank0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_config(ckpt_dir, fp, cfg, tokenizer=tok_info)
            live = ckpt_dir / ckpt.LIVE_METRICS
            if live.exists():
                live.unlink()
        torch.distributed.barrier()

        # ---- model (base frozen unless full), optimizer over the trainable parameters only
        ft, extra = attach(rt, gpt, a.method, mcfg, arch)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        model = DDP(tcfg, ddp_cfg, ft)
        model.broadcast_params()
        opt = MixedPrecisionAdamW(
            model,
            lr=a.lr,
            weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2),
            eps=1e-8,
            clip_grad=a.clip_grad,
        )
        sched = CosineSchedule(a.lr, a.min_lr, a.warmup_steps, a.steps, a.lr_decay_style)
        trainable = _model_numel(ft, rt.tp, trainable_only=True)
        total = _model_numel(ft, rt.tp)
        log(
            f"finetune {a.method}: {models.describe(arch, vocab)}; {trainable:,} of {total:,} parameters train "
            f"({100.0 * trainable / total:.3f}%); {len(train_ex)} train examples in {len(items)} sequences, "
            f"{len(valid_ex)} validation; truncated contexts {train_stats['context_truncated']}; "
            f"{precision} on {'GPU' if rt.cuda else 'CPU'}, world {rt.world_size} = dp {dp} x tp {a.tp}",
            rank0,
        )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        early = EarlyStopping(a.patience or None, a.min_delta)

        def sharded_state(is_loading: bool = False) -> dict:
            msd = trainable_sharded_state(a.method, ft, extra)
            return {
                "model": msd,
                "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading),
                "rng_state": ShardedObject(
                    "rng_state", [rng_states(rt.cuda)], (1, rt.tp), (0, tp_rank), replica_id=dp_rank
                ),
            }

        def common_state(step: int) -> dict:
            return {
                "iteration": step,
                "checkpoint_version": 3.0,
                "opt_param_scheduler": sched.state_dict(step),
                "snakellm": {
                    "fingerprint": fp,
                    "method": a.method,
                    "early_stopping": {"best": early.best, "bad_evals": early.bad_evals},
                },
            }

        manager = ckpt.CheckpointManager(
            ckpt_dir,
            keep_last=a.keep_last,
            sharded_state=sharded_state,
            common_state=common_state,
            rank=rt.rank,
            barrier=torch.distributed.barrier,
            log=lambda m: log(m, rank0),
            best=ckpt.read_best(ckpt_dir) if latest else None,
        )
        start_it = 0
        if latest is not None:
            loaded, common = manager.restore(latest)
            load_trainable(a.method, ft, extra, loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            rng = loaded["rng_state"]
            set_rng_states(rng[0] if isinstance(rng, list) else rng, rt.cuda)
            es = common.get("snakellm", {}).get("early_stopping", {})
            early.best, early.bad_evals = es.get("best"), int(es.get("bad_evals", 0))
            start_it = latest
            if rank0:
                ckpt.truncate_live_metrics(ckpt_dir, start_it)
            log(f"resumed from {ckpt_dir / ckpt.iter_name(start_it)}", rank0)

        # ---- batches: epochs of seeded permutations, indexed by the global sample number (exact resume)
        def make_batch(idx: list[int]) -> dict:
            if a.packing:
                b = ds.collate_packed(
                    [[train_ex[i] for i in items[j]] for j in idx], seq, tok.eod_id, a.answer_only_loss
                )
                b["attention_mask"] = ds.packed_attention_mask(b.pop("segment_ids"))
                return b
            b = ds.collate(
                [train_ex[items[j][0]] for j in idx],
                tok.eod_id,
                a.answer_only_loss,
                pad_to=seq if a.pad_to_max else None,
            )
            if virtual and not a.answer_only_loss:
                b["loss_mask"][:, :virtual] = 0
            return b

        def train_batches():
            for it in range(start_it + 1, a.steps + 1):
                order = ds.sample_order(len(items), a.seed, (it - 1) * a.global_batch_size, a.global_batch_size)
                mine = order[dp_rank::dp]
                for m in range(num_micro):
                    yield make_batch(mine[m * a.micro_batch_size : (m + 1) * a.micro_batch_size])

        def valid_batches():
            mine = list(range(len(valid_ex)))[dp_rank::dp]
            for k in range(0, len(mine), a.micro_batch_size):
                b = ds.collate([valid_ex[i] for i in mine[k : k + a.micro_batch_size]], tok.eod_id, a.answer_only_loss)
                if virtual and not a.answer_only_loss:
                    b["loss_mask"][:, :virtual] = 0
                yield b

        def to_dev(b: dict) -> dict:
            return {k: v.to(rt.device, non_blocking=True) for k, v in b.items()}

        def sft_loss(m, b: dict):
            """Answer-only loss: the token mean over the micro-batch's loss mask (NeMo's masked mean)."""
            per_tok = m(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
            mask = b["loss_mask"].to(per_tok.device)
            return (per_tok.float() * mask).sum() / mask.sum().clamp(min=1)

        # MFU by pretraining's formula (6 N + 12 L h s per token), so methods and pretraining compare as tokens/s
        # do; frozen weights in fact skip their weight gradients (about a third less work)
        flops_tok = counts.flops_per_token(arch, vocab)
        peak = peak_tflops_of(torch.cuda.get_device_name(rt.device)) if rt.cuda else None
        metrics = MetricsLogger(
            ckpt_dir / ckpt.LIVE_METRICS,
            rank0=rank0,
            tokens_per_step=a.global_batch_size * seq,
            samples_per_step=a.global_batch_size,
            flops_per_token=flops_tok,
            peak_tflops=peak,
            world_size=rt.world_size,
            dp_group=dp_group,
            dp_size=dp,
            start_step=start_it,
        )
        validator = (
            Validator(model, valid_batches, sft_loss, to_device=to_dev, dp_group=dp_group, dp_size=dp)
            if valid_ex
            else None
        )
        stop_group = torch.distributed.new_group(backend="gloo") if rt.cuda and rt.world_size > 1 else None
        stop = StopPolicy(
            max_time=a.max_time,
            max_time_text=f"{a.max_time}s",
            world_size=rt.world_size,
            group=stop_group,
            prog="snakellm finetune",
        )
        trainer = Trainer(
            model=model,
            optimizer=opt,
            lr_schedule=sched,
            batches=train_batches(),
            loss_fn=sft_loss,
            num_micro=num_micro,
            intervals=Intervals(a.steps, a.eval_interval, a.eval_interval, 1, a.checkpoints),
            metrics=metrics,
            stop=stop,
            checkpoints=manager,
            validator=validator,
            early_stop=early if a.patience else None,
            to_device=to_dev,
            start_step=start_it,
            rank0=rank0,
            desc=f"finetune {a.method}",
            show_progress=a.progress,
        )
        status = trainer.fit()
        if status != T_OK:
            return EXIT_STOPPED
        it = trainer.step

        # ---- the artifacts, from the best checkpoint (validation loss), else the last step
        best = manager.best
        chosen = best["iteration"] if best and a.checkpoints and a.select == "best" else it
        if chosen != it:
            loaded = ckpt.load(ckpt_dir, chosen, {"model": trainable_sharded_state(a.method, ft, extra)})
            load_trainable(a.method, ft, extra, loaded["model"])
        artifacts.write(a, rt, ft, extra, mcfg, arch, vocab, cfg, tok_info, fp, out)
        if rank0:
            recs = merge_metrics(ckpt_dir / ckpt.LIVE_METRICS)
            write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
            train_recs = [r for r in recs if "loss" in r]
            tps = sorted(r["tokens_per_s"] for r in train_recs[1:] or train_recs)
            write_json(
                out / "finetune_summary.json",
                {
                    "method": a.method,
                    "method_config": mcfg.as_dict() if mcfg else None,
                    "base": str(base_ckpt),
                    "steps_run": it,
                    "steps": a.steps,
                    "stopped_early": trainer.stopped_by,
                    "best": best,
                    "chosen_iteration": chosen,
                    "first_loss": train_recs[0]["loss"] if train_recs else None,
                    "final_loss": train_recs[-1]["loss"] if train_recs else None,
                    "val_losses": [{"step": r["step"], "val_loss": r["val_loss"]} for r in recs if "val_loss" in r],
                    "trainable_parameters": trainable,
                    "total_parameters": total,
                    "precision": precision,
                    "train_examples": len(train_ex),
                    "sequences": len(items),
                    "validation_examples": len(valid_ex),
                    "encode": train_stats,
                    "median_tokens_per_s": tps[len(tps) // 2] if tps else None,
                    "flops_per_token": flops_tok,
                    "fingerprint": fp,
                },
            )
        torch.distributed.barrier()
        return EXIT_OK
    finally:
        runtime.stop()


def _model_numel(module, tp: int, trainable_only: bool = False) -> int:
    """Parameters of the whole model, not of this rank's shard: a tensor-parallel split counts tp times."""
    return sum(
        p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        for p in module.parameters()
        if p.requires_grad or not trainable_only
    )


def load_trainable(method: str, ft, extra, loaded: dict) -> None:
    import torch

    with torch.no_grad():
        if method == "full":
            ft.gpt.load_state_dict(loaded, strict=False)
        elif method == "lora":
            extra.load_sharded(loaded)
        else:
            for n, p in extra.encoder.named_parameters():
                p.copy_(loaded[f"ptuning.{n}"])


def main(argv: list[str] | None = None) -> int:
    from snakellm.finetune.dataset import SFTFormatError
    from snakellm.finetune.runtime import BaseModelError

    a = build_parser().parse_args(argv)
    try:
        return finetune(a)
    except (SFTFormatError, BaseModelError, ValueError, ckpt.CheckpointError) as e:
        print(f"snakellm finetune: error: {e}", file=sys.stderr)
        return EXIT_USAGE if not isinstance(e, ckpt.CheckpointError) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
