"""``method: dpo``: preference tuning as one more recipe over the one training assembly.

What it changes against SFT (:class:`snakellm.finetune.recipe.FinetuneRecipe`): the data are
preference pairs (snakellm.finetune.preference: TRL's tokenization and truncation), a
micro-batch is its pairs' chosen rows then their rejected rows, the loss is TRL's DPO loss of
the policy's summed completion log-probabilities against the reference's, and each step line
of ``metrics.jsonl`` carries TRL's metrics (``rewards/*``, ``logps/*``). The reference's
log-probabilities come from the ``reference_logprobs`` file target (computed once by
:mod:`snakellm.finetune.reference`, not rebuilt for a new beta, loss or learning rate), or, with
``dpo.reference: adapter-off``, from the same model with its LoRA adapters off, in-process.
What trains (``dpo.policy``: lora | full), checkpoints, resume and the artifacts are SFT's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from snakellm.config.sections import DPO_TOKENIZATION, DpoSettings
from snakellm.finetune import dataset as ds
from snakellm.finetune import preference as pref
from snakellm.finetune.recipe import FinetuneRecipe
from snakellm.io.atomic import write_json
from snakellm.train import assembly
from snakellm.train.trainer import Batch

DPO_KEYS = tuple(f.name for f in DpoSettings.__dataclass_fields__.values())


def dpo_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The ``dpo`` block from ``snakellm finetune``'s flags (``--dpo-*``)."""
    from dataclasses import fields

    from snakellm.config.settings import dest

    return {f.name: getattr(a, dest(f)) for f in fields(DpoSettings)}


def truncation(d: dict[str, Any], seq_length: int) -> pref.Truncation:
    """The pairs' truncation; ``max_length`` defaults to what the model sees (its seq_length + the last label)."""
    limit = seq_length + 1
    if d["max_length"] is not None and d["max_length"] > limit:
        raise ds.SFTFormatError(
            f"dpo.max_length {d['max_length']}: the model sees {seq_length} positions (at most {limit} tokens a sequence)"
        )
    return pref.Truncation(d["max_length"] or limit, d["max_prompt_length"], d["truncation_mode"])


def chat_encoder(tok_info: dict, tok: Any, chat_template: str | None, seq: int, records: list[list[dict]]) -> Any:
    """The run's chat template and tokenizer where the pairs are conversational (else None)."""
    if not any(pref.is_conversational(r) for r in records):
        return None
    from snakellm.finetune import conversations as conv

    return conv.chat_encoder(tok_info, tok, chat_template, seq + 1, "all_assistant")


class DPORecipe(FinetuneRecipe):
    """Preference pairs, the reference's log-probabilities, TRL's losses and metrics."""

    def __init__(self, a: argparse.Namespace, mcfg: Any):
        self.dpo = dpo_settings(a)
        why = pref.check_settings(
            self.dpo["loss"], self.dpo["beta"], self.dpo["label_smoothing"], self.dpo["reference"], self.dpo["policy"]
        )
        if why:
            raise ds.SFTFormatError(why)
        self.inline_ref = self.dpo["reference"] == "adapter-off"
        self.ref_free = self.dpo["loss"] in pref.REFERENCE_FREE
        super().__init__(a, mcfg)

    # ------------------------------------------------------------------ data

    def _encode(self) -> None:
        from snakellm.finetune.runtime import load_tokenizer

        a = self.a
        self.tok = load_tokenizer(self.tok_info)
        self.trunc = truncation(self.dpo, self.seq)
        self.pairs: dict[str, list[pref.Pair]] = {}
        self.pair_stats: dict[str, dict[str, int]] = {}
        read = {
            split: ds.read_jsonl(path, pref.KEYS) if split == "train" or path.read_text().strip() else []
            for split, path in (("train", self.train_path), ("validation", self.valid_path))
        }
        self.chat = chat_encoder(
            self.tok_info, self.tok, getattr(a, "chat_template", None), self.seq, list(read.values())
        )
        if self.chat is not None:
            self.is_chat, self.chat_template = True, self.chat.template.source
        for split, recs in read.items():
            self.pairs[split], self.pair_stats[split] = pref.encode_pairs(self.tok, recs, self.trunc, self.chat)
        # the held-out pairs (the comparison's): prepare-sft's test split, where it has any
        self.test_path = self.train_path.parent / "test.jsonl"
        if self.test_path.is_file() and self.test_path.read_text().strip():
            self.pairs["test"], self.pair_stats["test"] = pref.encode_pairs(
                self.tok, ds.read_jsonl(self.test_path, pref.KEYS), self.trunc, self.chat
            )
        if not self.pairs["train"]:
            raise ds.SFTFormatError(f"{self.train_path}: no pair left after truncation ({self.pair_stats['train']})")
        self.ref: dict[str, dict[str, list[float]]] = {}
        self.ref_sha: str | None = None
        # whether the policy starts as its reference (TRL's default): then the held-out comparison's "base"
        # side is the reference's own numbers (rewards 0, ties), with no forward pass of the initial policy
        self.starts_as_reference = self.inline_ref and getattr(self.mcfg, "row_init", "zero") == "zero"
        self.before: dict[str, Any] | None = None
        if not (self.inline_ref or self.ref_free):
            self._read_reference()
        if a.eval_examples:
            self.pairs["validation"] = self.pairs["validation"][: a.eval_examples]
        self.items = [[i] for i in range(len(self.pairs["train"]))]
        # what the SFT parts of the recipe read
        self.train_ex, self.valid_ex = self.pairs["train"], self.pairs["validation"]  # type: ignore[assignment]
        self.train_stats, self.valid_stats = self.pair_stats["train"], self.pair_stats["validation"]
        self.train_stats.setdefault("context_truncated", self.train_stats["truncated"])

    def _read_reference(self) -> None:
        path = getattr(self.a, "reference_logprobs", None)
        if not path:
            raise ds.SFTFormatError(
                f"dpo.reference {self.dpo['reference']}: --reference-logprobs FILE is needed (the reference_logprobs "
                "target); or dpo.reference adapter-off, or loss simpo (reference-free)"
            )
        f = Path(path)
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ds.SFTFormatError(f"{f}: not a reference log-probability file: {e}") from None
        want = {k: self.dpo[k] for k in DPO_TOKENIZATION}
        if doc.get("tokenization") != want:
            raise ds.SFTFormatError(
                f"{f}: computed for tokenization {doc.get('tokenization')}, this fine-tune has {want}"
            )
        splits = [("train", self.train_path), ("validation", self.valid_path)]
        if "test" in self.pairs and "test" in doc.get("splits", {}):
            splits.append(("test", self.test_path))
        else:  # a reference file without the test split: no held-out evaluation
            self.pairs.pop("test", None)
        for split, path_ in splits:
            if not self.pairs[split] and split not in doc.get("splits", {}):  # an empty split (share 0)
                self.ref[split] = {"chosen": [], "rejected": []}
                continue
            got = doc.get("splits", {}).get(split)
            if got is None or got.get("sha256") != ds.file_sha256(path_):
                raise ds.SFTFormatError(f"{f}: computed for other {split} pairs than {path_} (stale: rebuild it)")
            kept = [p.index for p in self.pairs[split]]
            if got["kept"] != kept:
                raise ds.SFTFormatError(
                    f"{f}: its {split} pairs are not this fine-tune's ({len(got['kept'])} vs {len(kept)})"
                )
            self.ref[split] = {"chosen": got["chosen"], "rejected": got["rejected"]}
        self.ref_sha = ds.file_sha256(f)
        # the reference is the model this fine-tune starts from (its checkpoint, no adapter on it)
        same = doc.get("adapter") is None and doc.get("iteration") == self.base["iteration"]
        same = same and Path(str(doc.get("checkpoint"))).resolve() == Path(self.base["checkpoint_dir"]).resolve()
        self.starts_as_reference = same and self.kind == "full" or same and self._lora_starts_zero()

    def _lora_starts_zero(self) -> bool:
        """A LoRA policy is its base before the first step where B (linear_out) starts at zero."""
        return self.kind == "lora" and getattr(self.mcfg, "row_init", "zero") == "zero"

    # ------------------------------------------------------------------ the recipe

    def trajectory(self, s: assembly.Session) -> dict[str, Any]:
        return super().trajectory(s) | {"dpo": self.dpo, "reference_logprobs": self.ref_sha}

    def build(self, s: assembly.Session) -> assembly.Parts:
        parts = super().build(s)
        # a sample is a pair, two sequences of up to seq tokens: tokens_per_s and the FLOP count count both
        parts.seq_length = 2 * self.seq
        pref.mask_padded_vocab(parts.gpt, int(self.tok_info["vocab_size"]))
        if self.inline_ref and self.extra is None:
            raise ds.SFTFormatError("dpo.reference adapter-off: the policy has no adapters")
        if self.pairs.get("test") and not self.starts_as_reference:
            # the comparison's base side: the initial policy on the held-out pairs, before any step (a resumed
            # job computes it again, from the same initial weights: its checkpoint is loaded after build)
            self.before = self.evaluate_split(s, "test")
        return parts

    def describe(self, s: assembly.Session, parts: assembly.Parts) -> str:
        text = (
            super()
            .describe(s, parts)
            .replace("train examples", "train pairs")
            .replace("validation;", "validation pairs;")
        )
        ref = "none (simpo)" if self.ref_free else self.dpo["reference"]
        return f"{text}; dpo loss {self.dpo['loss']}, beta {self.dpo['beta']}, reference {ref}"

    def loss(self, m: Any, b: Batch) -> Any:  # type: ignore[override]
        """TRL's loss of the micro-batch's pairs, and TRL's metrics (the trainer writes them per step)."""
        logps = pref.sequence_logps(m, b)
        n = logps.shape[0] // 2
        pc, pr = logps[:n], logps[n:]
        rc, rr = self._reference_logps(m, b, pc)
        return self._pair_loss(pc, pr, rc, rr, b)

    def _reference_logps(self, m: Any, b: Batch, like: Any) -> tuple[Any, Any]:
        """The reference's chosen and rejected log-probabilities of a micro-batch (zeros for simpo)."""
        import torch

        if self.ref_free:
            return torch.zeros_like(like), torch.zeros_like(like)
        if self.inline_ref:
            with torch.no_grad(), self.extra.disabled():
                ref = pref.sequence_logps(m, b)
            n = ref.shape[0] // 2
            return ref[:n], ref[n:]
        return b["ref_chosen"].to(like.device), b["ref_rejected"].to(like.device)

    def _pair_loss(self, pc: Any, pr: Any, rc: Any, rr: Any, b: Batch, held_out: bool = False) -> Any:
        n = pc.shape[0]
        ct = b["completion_tokens"].to(pc.device)
        mt = b["loss_mask"].to(pc.device).sum(dim=1)
        w = b["pair_weight"].to(pc.device)
        return pref.preference_loss(
            pc,
            pr,
            rc,
            rr,
            loss=self.dpo["loss"],
            beta=self.dpo["beta"],
            label_smoothing=self.dpo["label_smoothing"],
            simpo_gamma=self.dpo["simpo_gamma"],
            completion_tokens=(ct[:n], ct[n:]),
            predicted_tokens=(mt[:n], mt[n:]),
            weight=w,
            held_out=held_out,
        )

    def _pairs_batch(self, split: str, idx: list[int]) -> Batch:
        import torch

        pairs = self.pairs[split]
        b = pref.collate([pairs[max(i, 0)] for i in idx], self.tok.eod_id)
        b["pair_weight"] = torch.tensor([0.0 if i < 0 else 1.0 for i in idx])
        if self.ref:
            r = self.ref[split]
            b["ref_chosen"] = torch.tensor([r["chosen"][max(i, 0)] for i in idx], dtype=torch.float32)
            b["ref_rejected"] = torch.tensor([r["rejected"][max(i, 0)] for i in idx], dtype=torch.float32)
        for row, i in enumerate(idx):
            if i < 0:
                b["loss_mask"][row] = 0
                b["loss_mask"][row + len(idx)] = 0
        return b

    def _batch(self, idx: list[int]) -> Batch:
        return self._pairs_batch("train", [self.items[j][0] for j in idx])

    def valid_batches(self, s: assembly.Session) -> Callable[[], Iterable[Batch]] | None:
        from megatron.core import parallel_state

        a, pairs = self.a, self.pairs["validation"]
        if not pairs:
            return None
        mine = list(range(len(pairs)))[parallel_state.get_data_parallel_rank() :: s.dp]
        n = -(-len(pairs) // s.dp) if a.fsdp else len(mine)
        padded = mine + [-1] * (n - len(mine))

        def batches() -> Iterator[Batch]:
            for k in range(0, len(padded), a.micro_batch_size):
                yield self._pairs_batch("validation", padded[k : k + a.micro_batch_size])

        return batches

    def finish(self, done: assembly.Done) -> None:
        """SFT's artifacts and summary, then the held-out evaluation: the test split's reward accuracy and
        margins and the chosen completions' log-probability, after training ("test") and of the initial
        policy ("test_before"; the comparison target's two sides, snakellm.eval.compare.preference)."""
        super().finish(done)
        if not self.pairs.get("test"):
            return
        result = self.evaluate_split(done.session, "test")
        before = self.before or self.evaluate_split(done.session, "test", as_reference=True)
        if done.session.rank0:
            path = Path(self.a.out_dir) / "finetune_summary.json"
            write_json(path, json.loads(path.read_text()) | {"test": result, "test_before": before})
            # the held-out preference metrics (reward accuracy, margins ...) for the job's W&B / MLflow runs
            done.trainer.metrics.summary({"eval/test": result})

    def evaluate_split(self, s: assembly.Session, split: str, as_reference: bool = False) -> dict[str, Any]:
        """TRL's metrics, the loss and the reward accuracy with ties counted half over a split's pairs, with the
        policy as it is (eval mode, no gradients); ``as_reference``: of a policy equal to its reference (the
        initial policy, where it starts as the reference: every reward 0)."""
        import torch

        model, pairs = self.ft, self.pairs[split]
        model.eval()
        sums: dict[str, float] = {}
        with torch.no_grad():
            for k in range(0, len(pairs), self.a.micro_batch_size):
                idx = list(range(k, min(k + self.a.micro_batch_size, len(pairs))))
                b = s.to_device(self._pairs_batch(split, idx))
                if as_reference:
                    like = torch.zeros(len(idx), device=b["tokens"].device)
                    pc, pr = rc, rr = self._reference_logps(model, b, like)
                else:
                    logps = pref.sequence_logps(model, b)
                    pc, pr = logps[: len(idx)], logps[len(idx) :]
                    rc, rr = self._reference_logps(model, b, pc)
                loss, stats = self._pair_loss(pc, pr, rc, rr, b, held_out=True)
                for name, v in {"loss": loss, **stats}.items():
                    sums[name] = sums.get(name, 0.0) + float(v) * len(idx)
                if not self.ref_free:
                    sums["reference_logps/chosen"] = sums.get("reference_logps/chosen", 0.0) + float(rc.sum())
        model.train()
        out = {k: v / len(pairs) for k, v in sums.items()}
        return {"pairs": len(pairs), **dict(sorted(out.items()))}

    def meta(self) -> dict[str, Any]:
        return {"method": "dpo", "dpo_policy": self.kind}

    def _summary(self, done: assembly.Done, chosen: int, out: Path) -> None:
        super()._summary(done, chosen, out)
        if not done.session.rank0:
            return
        path = out / "finetune_summary.json"
        summary = json.loads(path.read_text())
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in recs if "loss" in r]
        summary["dpo"] = self.dpo
        summary["reference_logprobs_sha256"] = self.ref_sha
        summary["pairs"] = self.pair_stats
        if steps:
            summary["first_step"] = {k: steps[0].get(k) for k in ("loss", *pref.METRICS)}
            summary["last_step"] = {k: steps[-1].get(k) for k in ("loss", *pref.METRICS)}
        write_json(path, summary)
