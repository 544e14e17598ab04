"""``snakellm lora merge|export-peft``: LoRA adapters as artifacts.

``merge``: base checkpoint + adapter -> a model-only checkpoint directory
(``OUT/checkpoints/iter_0000000``) holding ``W + (alpha/r) B A`` for every
adapted linear; it loads and exports like any pretrained run, and gives the
logits of base + adapter. ``merge-hf``: the same fold written straight to a
Hugging Face directory (what ``PeftModel.merge_and_unload`` would save), one
layer in memory at a time, so a 7-8B base merges on a login node and no second
full-size checkpoint is written on the way. ``export-peft``: the adapter in
Hugging Face PEFT format for the Hugging Face export of the base
(snakellm.finetune.peft_export).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


def merge_hf(base: str, adapter: str, out: str, *, max_shard_size: str = "5GB", dtype: str = "auto") -> Path:
    """Base checkpoint + LoRA adapter -> a Hugging Face directory of ``W + (alpha/r) B A``, streamed.

    The base is read one layer at a time (as ``export-hf`` reads it) and each adapted linear gets its
    update in fp32 before the cast back to the checkpoint's dtype; saved modules (``modules_to_save``)
    replace the base's. Tokenizer files and chat template come from the base run, as for ``export-hf``.
    """
    from safetensors.torch import load_file

    from snakellm.export.hf import export_hf_from_checkpoint
    from snakellm.finetune.lora import LoRAConfig
    from snakellm.launch.runtime import ensure_single_process
    from snakellm.models.loading import describe_run

    info = describe_run(base)
    ensure_single_process("cpu")  # the base is read through a meta-device megatron-core model
    src = Path(adapter)
    conf = json.loads((src / "adapter_config.json").read_text())
    if conf.get("method") != "lora":
        raise ValueError(f"{src / 'adapter_config.json'}: method {conf.get('method')!r}, merge-hf merges lora")
    # the base the adapter was trained on (its seq_length is the fine-tune's: no weight depends on it)
    trained_on = {k: v for k, v in (conf.get("model") or {}).items() if k != "seq_length"}
    differ = sorted(k for k in trained_on if k in info["arch"] and trained_on[k] != info["arch"][k])
    if differ:
        raise ValueError(
            f"{src}: the adapter was trained on another model than {base} "
            + ", ".join(f"{k} {trained_on[k]!r} != {info['arch'][k]!r}" for k in differ[:3])
        )
    trained = (conf.get("tokenizer") or {}).get("chat_template")
    if trained:  # a chat fine-tune's template (its own setting or the base's) goes with the merged model
        info = {**info, "tokenizer": {**info["tokenizer"], "chat_template": trained}}
    scaling = LoRAConfig.from_dict(conf["lora"]).scaling
    tensors = load_file(str(src / "adapter.safetensors"))
    return export_hf_from_checkpoint(
        info,
        out,
        max_shard_size=max_shard_size,
        dtype=dtype,
        transform=lambda groups: merged_groups(groups, tensors, scaling, str(src)),
        source_extra={"adapter": str(src)},
    )


def merged_groups(
    groups: Iterator[dict[str, Any]], tensors: dict[str, Any], scaling: float, where: str
) -> Iterator[dict[str, Any]]:
    """The base's tensor groups with every adapter folded in; an adapter tensor no base weight takes is an error."""
    left = set(tensors)
    for group in groups:
        out = {}
        for key, t in group.items():
            name = key.removesuffix(".weight")
            if key.endswith(".weight") and f"{name}.lora_a" in tensors:
                a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
                delta = (b.float() @ a.float()) * scaling
                if delta.shape != t.shape:
                    raise ValueError(
                        f"{where}: adapter {name} gives {tuple(delta.shape)}, the base weight is {tuple(t.shape)}"
                    )
                t = (t.float() + delta).to(t.dtype)
                left -= {f"{name}.lora_a", f"{name}.lora_b"}
            elif key in tensors:  # modules_to_save: trained whole beside the adapters
                t = tensors[key].to(t.dtype)
                left.discard(key)
            out[key] = t
        yield out
    if left:
        raise ValueError(f"{where}: adapter tensors {sorted(left)[:4]} match no weight of the base")
