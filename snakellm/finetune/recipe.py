"""Fine-tuning recipes (LoRA, full, p-tuning) for the one training assembly (:mod:`snakellm.train.assembly`).

What a fine-tune changes against pretraining, and nothing else:

* the model: a pretrained (or imported, or fully fine-tuned) run, read by
  :func:`snakellm.models.load` at the job's tensor-parallel size;
* which parameters train: ``full`` all of them; ``lora`` adapters on
  megatron-core's linears (snakellm.finetune.lora), base frozen; ``ptuning``
  a prompt encoder for N virtual tokens (snakellm.finetune.ptuning), base
  frozen. Checkpoints and the optimizer hold only what trains;
* the data: NeMo-style SFT examples with answer-only loss
  (snakellm.finetune.dataset), epochs of seeded permutations indexed by the
  global sample number (so a resumed job draws the same batches);
* the outputs: ``adapter/``, ``prompt/`` or ``model/`` from the best (or
  last) checkpoint (snakellm.finetune.artifacts), ``metrics.jsonl`` and
  ``finetune_summary.json``.

Resume (``--resume``, ``--on-config-change``), checkpoints, the stop policy,
metrics and early stopping are the assembly's, as in pretraining.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from snakellm import tracking
from snakellm.config.sections import ExamplesSettings, FinetuneTrainSettings
from snakellm.config.settings import trajectory_keys
from snakellm.finetune import dataset as ds
from snakellm.io import checkpoint as ckpt
from snakellm.io.atomic import write_json, write_text
from snakellm.models import fp8, moe
from snakellm.train import assembly
from snakellm.train.resume import check_required
from snakellm.train.trainer import Batch

METHODS = ("lora", "full", "ptuning", "dpo")
# the fingerprinted settings: the fields marked trajectory (precision enters resolved, by the session)
TRAJECTORY = tuple(k for k in trajectory_keys(FinetuneTrainSettings) if k not in ("precision", "fp8_recipe"))
EXAMPLE_KEYS = trajectory_keys(ExamplesSettings)
CHAT_KEYS = ("chat_template", "train_on")


def finetune(a: argparse.Namespace, mcfg: Any) -> int:
    """Run one fine-tune to its last step (0) or a clean stop (75); ``mcfg``: the method's config (or None)."""
    fp8.check_request(a.precision, a.device)
    check_parallel(a)
    job = job_of(a)
    check_required(job.ckpt_dir, job)  # before the base and the data are read
    if a.method == "dpo":
        from snakellm.finetune.dpo import DPORecipe

        recipe: FinetuneRecipe = DPORecipe(a, mcfg)
    else:
        recipe = FinetuneRecipe(a, mcfg)
    # tensor parallelism on gloo as pretraining's, refused with the base's dropout (megatron-core's CUDA tracker)
    dropout = bool(recipe.arch.get("hidden_dropout") or recipe.arch.get("attention_dropout"))
    return assembly.run(dataclasses.replace(job, dropout=dropout), recipe)


def check_parallel(a: argparse.Namespace) -> None:
    """The parallelism flags against each other and the method (the config check's rule), naming the flags."""
    from dataclasses import fields

    from snakellm.config.sections import FinetuneParallelSettings, FinetuneSettings
    from snakellm.config.settings import option
    from snakellm.models import grad_reduce_conflict, parallel_conflict

    flags = {f.name: option(f) for cls in (FinetuneSettings, FinetuneParallelSettings) for f in fields(cls)}
    kind = a.dpo_policy if a.method == "dpo" else a.method  # what trains
    conflict = parallel_conflict({"tp": a.tp, "fsdp": a.fsdp, "method": kind}, flags.__getitem__)
    if conflict:
        raise assembly.JobError(f"{flags[conflict[0]]} {conflict[1]}")
    why = grad_reduce_conflict(a.grad_reduce_dtype, a.precision)
    if why:
        raise assembly.JobError(f"--grad-reduce-dtype {a.grad_reduce_dtype} {why}")


def job_of(a: argparse.Namespace) -> assembly.Job:
    """The assembly's job from ``snakellm finetune``'s arguments."""
    return assembly.Job(
        prog="snakellm finetune",
        desc=f"finetune {a.method}",
        run_name=Path(a.out_dir).name,
        run_dir=Path(a.out_dir),
        device=a.device,
        steps=a.steps,
        global_batch_size=a.global_batch_size,
        micro_batch_size=a.micro_batch_size,
        optim=assembly.Optim(
            lr=a.lr,
            min_lr=a.min_lr,
            warmup_steps=a.warmup_steps,
            decay_steps=a.steps,
            decay_style=a.lr_decay_style,
            weight_decay=a.weight_decay,
            betas=(a.adam_beta1, a.adam_beta2),
            clip_grad=a.clip_grad,
            fsdp=a.fsdp,
            grad_reduce_bf16=a.grad_reduce_dtype == "bf16",
        ),
        tp=a.tp,
        threads=a.threads,
        seed=a.seed,
        precision=a.precision,
        resume=a.resume,
        on_config_change=a.on_config_change,
        save_interval=a.eval_interval,
        eval_interval=a.eval_interval,
        log_interval=1,
        keep_last=a.keep_last,
        patience=a.patience,
        min_delta=a.min_delta,
        max_time=a.max_time,
        max_time_text=f"{a.max_time}s",
        checkpoints=a.checkpoints,
        progress=a.progress,
        overlap_grad_reduce=False,
        profile_steps=a.profile_steps,
        tracking=tracking.settings_from_args(a),
        params=vars(a),
        cpu_tp=True,  # fp32 on gloo ranks as pretraining (tests/test_dpo.py: DPO at tp 2 equals tp 1)
    )


class FinetuneRecipe:
    """One method over one base run and one SFT data directory."""

    def __init__(self, a: argparse.Namespace, mcfg: Any):
        from snakellm.models.loading import describe_run

        self.a, self.mcfg = a, mcfg
        self.kind = a.dpo_policy if a.method == "dpo" else a.method  # which parameters train: lora | full | ptuning
        self.train_path, self.valid_path = Path(a.data_dir) / "train.jsonl", Path(a.data_dir) / "validation.jsonl"
        for f in (self.train_path, self.valid_path):
            if not f.is_file():
                raise ds.SFTFormatError(f"{f}: not found (run snakellm prepare-sft)")
        if a.global_batch_size % a.micro_batch_size:
            raise ds.SFTFormatError(
                f"global batch {a.global_batch_size} is not a multiple of micro batch {a.micro_batch_size}"
            )
        self.base = describe_run(a.base, seq_length=a.max_seq_length, tp=a.tp)
        self.arch, self.vocab = self.base["arch"], self.base["padded_vocab_size"]
        why = moe.check_tp(self.arch, a.tp, None, lambda k: f"--{k}")  # fine-tuning runs no sequence parallelism
        if why:
            raise assembly.JobError(f"base {a.base}: {why}")
        self.seq = a.max_seq_length or self.arch["seq_length"]
        self.tok_info = self.base["tokenizer"]  # the base run's own copy (snakellm.io.run_tokenizer)
        self.virtual = mcfg.virtual_tokens if a.method == "ptuning" else 0
        self.is_chat = False
        self.chat_template: str | None = None
        self.chat_text: str | None = None
        self._encode()
        self.extra: Any = None
        self.ft: Any = None

    def _encode(self) -> None:
        from snakellm.finetune import conversations as conv
        from snakellm.finetune.runtime import load_tokenizer

        a = self.a
        self.tok = load_tokenizer(self.tok_info)
        prefix = [int(self.tok.eod_id)] * self.virtual

        def encode(path: Path) -> tuple[list[ds.Example], dict[str, int]]:
            records = ds.read_jsonl(path)
            if any(conv.is_conversation(r) for r in records):
                return encode_chat(path, records)
            enc = ds.Encoder(
                self.tok,
                self.seq + 1,
                a.template,
                a.add_bos,
                a.add_eos,
                a.truncation_method,
                reserved=self.virtual,
                truncation_field=a.truncation_field,
            )
            exs = enc.encode_all(records)
            warning = ds.truncation_warning(path, exs, enc)
            if warning:
                print(f"snakellm finetune: {warning}", file=sys.stderr)
            for e in exs:
                e.context = prefix + e.context
            return exs, enc.stats.as_dict()

        def encode_chat(path: Path, records: list[dict]) -> tuple[list[ds.Example], dict[str, int]]:
            if not all(conv.is_conversation(r) for r in records):
                raise ds.SFTFormatError(f"{path}: conversations and input/output records mixed in one file")
            enc = conv.chat_encoder(self.tok_info, self.tok, a.chat_template, self.seq + 1, a.train_on, self.virtual)
            exs = enc.encode_all(records, str(path))
            warning = conv.length_warning(path, enc)
            if warning:
                print(f"snakellm finetune: {warning}", file=sys.stderr)
            if not exs:
                raise ds.SFTFormatError(f"{path}: every conversation is longer than {self.seq} tokens")
            for e in exs:
                e.context = prefix + e.context
                e.mask = [0] * len(prefix) + (e.mask or [])
            self.chat_template = enc.template.source
            self.chat_text = enc.template.text
            self.is_chat = True
            return exs, enc.stats.as_dict() | {"context_truncated": enc.stats.shortened}

        self.train_ex, self.train_stats = encode(self.train_path)
        self.valid_ex, self.valid_stats = encode(self.valid_path)
        if a.eval_examples:
            self.valid_ex = self.valid_ex[: a.eval_examples]
        self.items = (
            [[i] for i in range(len(self.train_ex))] if not a.packing else ds.pack(self.train_ex, self.seq, a.seed)
        )
        if not a.packing and a.method != "ptuning" and len(self.train_ex) > 1:
            rows = len(ds.pack(self.train_ex, self.seq, a.seed))
            if 2 * rows <= len(self.train_ex):  # padding would be at least half of every step's tokens
                print(
                    f"snakellm finetune: note: packing (examples.packing: true, --packing) would hold the "
                    f"{len(self.train_ex)} training examples in {rows} sequences of {self.seq} tokens",
                    file=sys.stderr,
                )

    @property
    def base_checkpoint(self) -> Path:
        return Path(self.base["checkpoint_dir"]) / ckpt.iter_name(self.base["iteration"])

    def start_summary(self) -> Path | None:
        """Where the base is a full fine-tune's model/ (a fine-tune's ``start``): that fine-tune's summary."""
        run_dir = Path(self.base["run_dir"])
        summary = run_dir.parent / "finetune_summary.json"
        return summary if run_dir.name == "model" and summary.is_file() else None

    def trajectory(self, s: assembly.Session) -> dict[str, Any]:
        a = self.a
        start = self.start_summary()
        # a start retrained (its summary rewritten) is another initial model: this fine-tune starts afresh
        started = {"start": ds.file_sha256(start)} if start else {}
        return started | {
            "method": a.method,
            "method_config": self.mcfg.as_dict() if self.mcfg else None,
            "base": str(self.base_checkpoint),
            "model": self.arch,
            "padded_vocab": self.vocab,
            "data": {"train": ds.file_sha256(self.train_path), "validation": ds.file_sha256(self.valid_path)},
            # the chat settings enter only for conversations (an input/output fine-tune keeps its fingerprint)
            "examples": {k: getattr(a, k) for k in EXAMPLE_KEYS if self.is_chat or k not in CHAT_KEYS}
            | {"seq": self.seq},
            "train": {k: getattr(a, k) for k in TRAJECTORY} | fp8.trajectory(s.precision, a.fp8_recipe),
        }

    def record(self) -> dict[str, Any]:
        return {"tokenizer": self.tok_info}

    def build(self, s: assembly.Session) -> assembly.Parts:
        from snakellm import models

        kernel = self.a.packed_attention if self.a.packing else "dense"
        if kernel != "dense":
            name = {"flex": "FlexAttention", "varlen": "flash variable-length attention"}[kernel]
            why = None if s.cuda else f"{name} has no backward pass on the CPU"
            if self.arch.get("attention_dropout"):
                why = f"{name} has no attention dropout (the model's is {self.arch['attention_dropout']})"
            if why:
                raise assembly.JobError(f"--packed-attention {kernel} (examples.packed_attention): {why}; use dense")
        tp = self.a.tp
        loaded = models.load(
            self.a.base,
            device=s.device,
            bf16=s.bf16,
            tp=tp,
            seq_length=self.a.max_seq_length,
            train=True,
            fp8=self.a.fp8_recipe if s.precision == "fp8" else None,
            recompute=self.a.recompute,
        )
        gpt = loaded.model
        if kernel != "dense":
            from snakellm.models.attention import set_packed_kernel

            set_packed_kernel(gpt, kernel)
        self.ft, self.extra = attach(s.torch, gpt, self.kind, self.mcfg, self.arch, self.a.recompute)
        if self.a.compile:  # after attach: the adapters' hooks are traced into each layer's graph
            from snakellm.models.build import compile_each_layer

            compile_each_layer(gpt.decoder.layers)
        return assembly.Parts(
            module=self.ft,
            config=loaded.config,
            gpt=gpt,
            seq_length=self.seq,
            # MFU by pretraining's formula (6 N + 12 L h s per token), so methods and pretraining compare as
            # tokens/s do; frozen weights in fact skip their weight gradients (about a third less work)
            flops_per_token=models.flops_per_token(self.arch, self.vocab),
            state=lambda: trainable_sharded_state(self.kind, self.ft, self.extra),
            load_state=lambda sd: load_trainable(self.kind, self.ft, self.extra, sd),
        )

    def describe(self, s: assembly.Session, parts: assembly.Parts) -> str:
        from snakellm.models import describe

        self.trainable = assembly.model_numel(self.ft, self.a.tp, trainable_only=True)
        self.total = assembly.model_numel(self.ft, self.a.tp)
        return (
            f"finetune {self.a.method}: {describe(self.arch, self.vocab)}; {self.trainable:,} of {self.total:,} "
            f"parameters train ({100.0 * self.trainable / self.total:.3f}%); {len(self.train_ex)} train examples "
            f"in {len(self.items)} sequences, {len(self.valid_ex)} validation; truncated contexts "
            f"{self.train_stats['context_truncated']}; {s.precision} on {'GPU' if s.cuda else 'CPU'}, world "
            f"{s.dist.world_size} = dp {s.dp} x tp {self.a.tp}"
            + (f"; parameters, gradients and optimizer sharded over {s.dp} ranks (FSDP2)" if self.a.fsdp else "")
        )

    @staticmethod
    def loss(m: Any, b: Batch) -> Any:
        """Answer-only loss: the token mean over the micro-batch's loss mask (NeMo's masked mean)."""
        per_tok = m(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
        mask = b["loss_mask"].to(per_tok.device)
        return (per_tok.float() * mask).sum() / mask.sum().clamp(min=1)

    def _batch(self, idx: list[int]) -> Batch:
        a, eod = self.a, self.tok.eod_id
        if a.packing:
            b = ds.collate_packed(
                [[self.train_ex[i] for i in self.items[j]] for j in idx], self.seq, eod, a.answer_only_loss
            )
            seg = b.pop("segment_ids")
            dense = a.packed_attention == "dense"
            b["attention_mask"] = ds.packed_attention_mask(seg) if dense else ds.packed_segments(seg)
            return b
        b = ds.collate(
            [self.train_ex[self.items[j][0]] for j in idx],
            eod,
            a.answer_only_loss,
            pad_to=self.seq if a.pad_to_max else None,
        )
        if self.virtual and not a.answer_only_loss:
            b["loss_mask"][:, : self.virtual] = 0
        return b

    def train_batches(self, s: assembly.Session, start_step: int) -> Iterator[Batch]:
        """Epochs of seeded permutations, indexed by the global sample number (exact resume)."""
        from megatron.core import parallel_state

        a, dp_rank = self.a, parallel_state.get_data_parallel_rank()
        for it in range(start_step + 1, a.steps + 1):
            order = ds.sample_order(len(self.items), a.seed, (it - 1) * a.global_batch_size, a.global_batch_size)
            mine = order[dp_rank :: s.dp]
            for m in range(s.num_micro):
                yield self._batch(mine[m * a.micro_batch_size : (m + 1) * a.micro_batch_size])

    def valid_batches(self, s: assembly.Session) -> Callable[[], Iterable[Batch]] | None:
        from megatron.core import parallel_state

        if not self.valid_ex:
            return None
        a, mine = self.a, list(range(len(self.valid_ex)))[parallel_state.get_data_parallel_rank() :: s.dp]
        # FSDP: every rank runs as many forward passes as the others (each gathers the weights with them);
        # a rank short of an example fills in example 0, unscored (its loss mask zero: the Validator skips a
        # batch of nothing but these)
        n = -(-len(self.valid_ex) // s.dp) if a.fsdp else len(mine)
        padded = mine + [-1] * (n - len(mine))

        def batches() -> Iterator[Batch]:
            for k in range(0, len(padded), a.micro_batch_size):
                idx = padded[k : k + a.micro_batch_size]
                b = ds.collate([self.valid_ex[max(i, 0)] for i in idx], self.tok.eod_id, a.answer_only_loss)
                if self.virtual and not a.answer_only_loss:
                    b["loss_mask"][:, : self.virtual] = 0
                for row, i in enumerate(idx):
                    if i < 0:
                        b["loss_mask"][row] = 0
                yield b

        return batches

    def meta(self) -> dict[str, Any]:
        return {"method": self.a.method}

    def finish(self, done: assembly.Done) -> None:
        """The artifacts from the best checkpoint (validation loss), else the last step; then the summary."""
        from snakellm.finetune import artifacts

        a, it, best = self.a, done.trainer.step, done.manager.best
        chosen = best["iteration"] if best and a.checkpoints and a.select == "best" else it
        if chosen != it:
            loaded = ckpt.load(done.manager.dir, chosen, {"model": done.parts.state()})
            done.parts.load_state(loaded["model"])
        out = Path(a.out_dir)
        meta = {
            "base": str(self.base_checkpoint),
            "model": self.arch,
            "padded_vocab": self.vocab,
            # the template a chat fine-tune trained with travels with what it wrote (exports, merges, serving)
            "tokenizer": {**self.tok_info, "chat_template": self.chat_text} if self.is_chat else self.tok_info,
            "examples": done.config["examples"],
            "fingerprint": done.fingerprint,
        }
        rank0 = done.session.dist.rank == 0
        artifacts.write(self.kind, rank0, self.ft, self.extra, self.mcfg, meta, out, done.parts.whole_state)
        if done.session.rank0:
            self._summary(done, chosen, out)

    def _summary(self, done: assembly.Done, chosen: int, out: Path) -> None:
        from snakellm.train.metrics import merge_metrics

        a = self.a
        recs = merge_metrics(done.manager.dir / ckpt.LIVE_METRICS)
        write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
        train_recs = [r for r in recs if "loss" in r]
        tps = sorted(r["tokens_per_s"] for r in train_recs[1:] or train_recs)
        summary = {
            "method": a.method,
            "method_config": self.mcfg.as_dict() if self.mcfg else None,
            "base": str(self.base_checkpoint),
            "steps_run": done.trainer.step,
            "steps": a.steps,
            "stopped_early": done.trainer.stopped_by,
            "best": done.manager.best,
            "chosen_iteration": chosen,
            "first_loss": train_recs[0]["loss"] if train_recs else None,
            "final_loss": train_recs[-1]["loss"] if train_recs else None,
            "val_losses": [{"step": r["step"], "val_loss": r["val_loss"]} for r in recs if "val_loss" in r],
            "trainable_parameters": self.trainable,
            "total_parameters": self.total,
            "precision": done.session.precision,
            "train_examples": len(self.train_ex),
            "sequences": len(self.items),
            "validation_examples": len(self.valid_ex),
            "encode": self.train_stats,
            "encode_validation": self.valid_stats,
            **({"chat_template": self.chat_template} if self.is_chat else {}),
            "median_tokens_per_s": tps[len(tps) // 2] if tps else None,
            "flops_per_token": done.parts.flops_per_token,
            "peak_gpu_memory_gib": _peak_gib(done.session),
            "fingerprint": done.fingerprint,
        }
        write_json(out / "finetune_summary.json", summary)
        done.trainer.metrics.summary(summary)


def _peak_gib(s: assembly.Session) -> float | None:
    """Rank 0's peak allocated GPU memory (GiB) over the job; None on the CPU."""
    if not s.cuda:
        return None
    return round(s.torch.cuda.max_memory_allocated(s.device) / 2**30, 2)


def attach(torch: Any, gpt: Any, method: str, mcfg: Any, arch: dict, recompute: str = "none") -> tuple[Any, Any]:
    """Freeze what must not train and add the method's module; returns (FTModel, extra module or None).

    With activation recomputation and a frozen base, the embedding's output is made to require a
    gradient: a recomputed block is an autograd function whose output needs a gradient only when an
    input does, and the frozen embedding's output does not (the adapters inside would get none).
    """
    from snakellm.finetune.runtime import make_ft_model

    ft = make_ft_model(torch, gpt)
    if method == "full":
        return ft, None
    for p in gpt.parameters():
        p.requires_grad_(False)
    if recompute != "none":
        gpt.embedding.register_forward_hook(lambda _m, _i, out: out.requires_grad_(torch.is_grad_enabled()))
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


def trainable_sharded_state(method: str, ft: Any, extra: Any) -> dict:
    """What a fine-tune's checkpoints hold of the model: the whole GPT (full), the adapters, or the encoder."""
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


def load_trainable(method: str, ft: Any, extra: Any, loaded: dict) -> None:
    """The inverse of :func:`trainable_sharded_state`: put a checkpoint's trained part back."""
    import torch

    with torch.no_grad():
        if method == "full":
            ft.gpt.load_state_dict(loaded, strict=False)
        elif method == "lora":
            extra.load_sharded(loaded)
        else:
            for n, p in extra.encoder.named_parameters():
                p.copy_(loaded[f"ptuning.{n}"])
