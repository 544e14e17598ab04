"""The ``reference_logprobs`` target: a frozen reference model's summed completion log-probabilities.

For every pair of every split of a prepared preference set (``data/sft/NAME/{train,validation,test}.jsonl``),
tokenized as the DPO fine-tune tokenizes it (snakellm.finetune.preference, the ``dpo`` block's
``max_length``, ``max_prompt_length``, ``truncation_mode``), the reference's log-probability of the
chosen and of the rejected completion. What it depends on is only the reference model, the pairs and
their tokenization: a new beta, loss, learning rate or step count reuses it (TRL's
``precompute_ref_log_probs`` lasts one run; this file lasts until its inputs change).

The file records each split's sha256 and the kept pairs' line numbers, so a fine-tune given a stale
file refuses it by name.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from snakellm.finetune import dataset as ds
from snakellm.finetune import preference as pref
from snakellm.io.atomic import write_json

SPLITS = ("train", "validation", "test")


def compute(
    model_dir: str,
    data_dir: str,
    out: str,
    tokenization: dict[str, Any],
    *,
    device: str = "auto",
    precision: str = "auto",
    batch_size: int = 8,
    threads: int | None = None,
    max_seq_length: int | None = None,
    chat_template: str | None = None,
    adapter: str | None = None,
) -> dict[str, Any]:
    """Write ``out`` (JSON) and return it; ``adapter``: a LoRA fine-tune's, on ``model_dir`` (its base)."""
    import torch

    from snakellm import models
    from snakellm.finetune import runtime
    from snakellm.finetune.dpo import chat_encoder, truncation
    from snakellm.models.loading import describe_run

    t0 = time.time()
    info = describe_run(model_dir, seq_length=max_seq_length)
    seq = max_seq_length or info["arch"]["seq_length"]
    trunc = truncation(tokenization, seq)
    rt = runtime.start(device, 1, threads)
    try:
        bf16 = precision == "bf16" or (precision == "auto" and rt.cuda)
        loaded = models.load(model_dir, device=rt.device, bf16=bf16, seq_length=max_seq_length)
        if adapter:  # the LoRA fine-tune's model: its base with its adapter on (as its evaluation loads it)
            from snakellm.finetune.artifacts import attach

            attach(rt.device, loaded.model, loaded.arch, adapter, None)
        gpt = loaded.model.eval()
        tok = runtime.load_tokenizer(info["tokenizer"])
        pref.mask_padded_vocab(gpt, int(info["tokenizer"]["vocab_size"]))
        splits: dict[str, Any] = {}
        paths = [Path(data_dir) / f"{s}.jsonl" for s in SPLITS]
        read = {
            p.stem: ds.read_jsonl(p, pref.KEYS) for p in paths if p.is_file() and p.read_text().strip()
        }  # a split of share 0 is empty
        chat = chat_encoder(info["tokenizer"], tok, chat_template, seq, list(read.values()))
        for split, recs in read.items():
            path = Path(data_dir) / f"{split}.jsonl"
            pairs, stats = pref.encode_pairs(tok, recs, trunc, chat)
            chosen: list[float] = []
            rejected: list[float] = []
            with torch.no_grad():
                for k in range(0, len(pairs), batch_size):
                    part = pairs[k : k + batch_size]
                    b = {kk: v.to(rt.device) for kk, v in pref.collate(part, tok.eod_id).items()}
                    lp = pref.sequence_logps(gpt, b).double().cpu().tolist()
                    chosen += lp[: len(part)]
                    rejected += lp[len(part) :]
            splits[split] = {
                "sha256": ds.file_sha256(path),
                "kept": [p.index for p in pairs],
                "chosen": chosen,
                "rejected": rejected,
                "stats": stats,
            }
        doc = {
            "reference": str(model_dir),
            "adapter": str(adapter) if adapter else None,
            "checkpoint": str(Path(info["checkpoint_dir"])),
            "iteration": info["iteration"],
            "precision": "bf16" if bf16 else "fp32",
            "tokenization": {k: tokenization[k] for k in ("max_length", "max_prompt_length", "truncation_mode")},
            "chat_template": chat.template.source if chat is not None else None,
            "seconds": round(time.time() - t0, 2),
            "splits": splits,
        }
        if not splits:
            raise ds.SFTFormatError(f"{data_dir}: no train/validation/test.jsonl (run snakellm prepare-sft)")
        write_json(Path(out), doc)
        return doc
    finally:
        runtime.stop()
