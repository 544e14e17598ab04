"""What ``snakellm finetune`` leaves behind, written and read back in one place.

* :func:`write`: ``adapter/`` (LoRA: adapter.safetensors + adapter_config.json),
  ``prompt/`` (p-tuning: the encoder and the virtual-token table) or ``model/``
  (full: a model-only checkpoint directory that :func:`snakellm.models.load` reads).
* :func:`attach`: a saved adapter or prompt table put back onto a base model
  (``snakellm evaluate`` and ``snakellm lora merge`` both need it, so it lives
  here rather than in either of them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snakellm.io.atomic import write_json


def write(
    method: str,
    rank0: bool,
    ft: Any,
    extra: Any,
    mcfg: Any,
    meta: dict[str, Any],
    out: Path,
    whole_state: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """adapter/ (LoRA), prompt/ (p-tuning) or model/ (full): what evaluate and the exporters read.

    ``meta`` (base, model, padded_vocab, tokenizer, examples, fingerprint) goes into the config file
    beside the tensors. Collective for ``lora`` and ``full`` (the tensor-parallel shards are gathered).
    ``whole_state``: the full model's sharded state dict where ``ft.gpt``'s own is not (FSDP's shards).
    """
    from safetensors.torch import save_file

    from snakellm.io.atomic import atomic_path

    if method == "lora":
        from snakellm.finetune.lora import full_tensors

        tensors = full_tensors(extra)
        if rank0:
            with atomic_path(out / "adapter" / "adapter.safetensors") as tmp:
                save_file(tensors, str(tmp), metadata={"format": "pt", "snakellm": "lora"})
            write_json(out / "adapter" / "adapter_config.json", {"method": "lora", "lora": mcfg.as_dict(), **meta})
    elif method == "ptuning":
        if rank0:
            enc = {k: v.detach().float().cpu().contiguous() for k, v in extra.encoder.state_dict().items()}
            with atomic_path(out / "prompt" / "prompt_encoder.safetensors") as tmp:
                save_file(enc, str(tmp))
            with atomic_path(out / "prompt" / "virtual_tokens.safetensors") as tmp:
                save_file({"prompt_table": extra.virtual_embeddings().contiguous()}, str(tmp))
            write_json(out / "prompt" / "prompt_config.json", {"method": "ptuning", "ptuning": mcfg.as_dict(), **meta})
    else:
        state = whole_state() if whole_state else None
        save_model(ft.gpt, out / "model", meta["model"], meta["padded_vocab"], meta["tokenizer"], state)


def save_model(
    gpt: Any, run_dir: Path, arch: dict, vocab: int, tokenizer: dict, state: dict[str, Any] | None = None
) -> Path:
    """A model-only checkpoint directory (iteration 0) that :func:`snakellm.models.load` reads like a run."""
    from snakellm.models.loading import save_model_checkpoint

    return save_model_checkpoint(run_dir, gpt, arch, vocab, tokenizer, sharded_state=state)


def attach(device: Any, gpt: Any, arch: dict, adapter: str | None, prompt: str | None) -> tuple[int, Any, Any]:
    """Put a saved LoRA adapter or p-tuning prompt table onto the base model; returns (virtual tokens, config)."""
    import torch
    from safetensors.torch import load_file

    if adapter:
        from snakellm.finetune.lora import LoRAAdapters, LoRAConfig, load_full_tensors

        conf = json.loads((Path(adapter) / "adapter_config.json").read_text())
        ad = LoRAAdapters(gpt, LoRAConfig.from_dict(conf["lora"]))
        load_full_tensors(ad, load_file(str(Path(adapter) / "adapter.safetensors")))
        return 0, conf, ad
    if prompt:
        from snakellm.finetune.ptuning import PTuning, PTuningConfig

        conf = json.loads((Path(prompt) / "prompt_config.json").read_text())
        pt = PTuning(
            gpt,
            PTuningConfig(**conf["ptuning"]),
            arch["hidden_size"],
            gpt.embedding.word_embeddings.weight.dtype,
            gpt.embedding.word_embeddings.weight.device,
        )
        table = load_file(str(Path(prompt) / "virtual_tokens.safetensors"))["prompt_table"]
        pt.table = table.to(device=device, dtype=torch.float32)
        return pt.cfg.virtual_tokens, conf, pt
    return 0, None, None
