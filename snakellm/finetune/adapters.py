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
    from snakellm.eval.evaluate import attach_artifacts
    from snakellm.finetune import runtime
    from snakellm.finetune.cli import save_model
    from snakellm.finetune.lora import merge as merge_into

    rt = runtime.start(device, tp)
    try:
        gpt, _, arch, vocab, _, tok_info = runtime.load_base(rt, base)
        _, conf, ad = attach_artifacts(rt, gpt, arch, adapter, None)
        merge_into(gpt, ad)
        return save_model(gpt, Path(out), arch, vocab, conf.get("tokenizer") or tok_info, rt)
    finally:
        runtime.stop()
