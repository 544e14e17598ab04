"""``snakellm lora merge|export-peft``: LoRA adapters as artifacts.

``merge``: base checkpoint + adapter -> a model-only checkpoint directory
(``OUT/checkpoints/iter_0000000``) holding ``W + (alpha/r) B A`` for every
adapted linear; it loads and exports like any pretrained run, and gives the
logits of base + adapter. ``export-peft``: the adapter in Hugging Face PEFT
format for the Hugging Face export of the base (snakellm.finetune.peft_export).
"""

from __future__ import annotations

from pathlib import Path


def merge(base: str, adapter: str, out: str, device: str = "auto", tp: int = 1) -> Path:
    """Base checkpoint + LoRA adapter -> a model-only checkpoint directory holding the merged weights."""
    from snakellm import models
    from snakellm.finetune import artifacts, runtime
    from snakellm.finetune.lora import merge as merge_into

    rt = runtime.start(device, tp)
    try:
        m = models.load(base, device=rt.device, tp=rt.tp)
        _, conf, ad = artifacts.attach(rt.device, m.model, m.arch, adapter, None)
        merge_into(m.model, ad)
        return artifacts.save_model(m.model, Path(out), m.arch, m.padded_vocab_size, m.tokenizer)
    finally:
        runtime.stop()
