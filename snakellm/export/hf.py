"""Hugging Face export and import: megatron-core GPTModel <-> the family's HF class (GPT2LMHeadModel, ...).

What a tensor or a config key is called on either side is the family's business
(``snakellm/models/families/<style>.py``: one weight table and one config table, read
in both directions); this module does the files: safetensors (sharded), config.json,
generation_config.json, the tokenizer files, atomic publication. megatron-core
tensors are taken by local-spec name; TE-spec ``layer_norm_*`` names are folded into
them first. The embedding (and an untied output layer) is padded to a multiple of
``make_vocab_size_divisible_by``: rows past the tokenizer's vocabulary are dropped on
export and zero-filled on import. Tied embeddings: no ``lm_head.weight`` in the file.

Which HF class a model maps to is decided from the architecture alone
(:func:`hf_family`), before any weights are read, so an unsupported combination
is an error before work starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.io.atomic import write_json
from snakellm.models import families
from snakellm.models.families import FamilyError


class ExportError(UsageError, ValueError):
    """A model that has no faithful Hugging Face equivalent, or a malformed HF directory."""


_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


# ----------------------------------------------------------------------------- architecture (no torch)


@contextlib.contextmanager
def _as_export_error() -> Iterator[None]:
    """A family's refusal, raised as this module's error (what the export and import callers catch)."""
    try:
        yield
    except FamilyError as e:
        raise ExportError(str(e)) from None


def hf_family(arch: dict[str, Any]) -> str:
    """The family (``gpt2``, ``llama``, ...) whose HF class computes exactly what this architecture does."""
    with _as_export_error():
        return families.for_arch(arch).name


def hf_config(arch: dict[str, Any], vocab_size: int, specials: dict[str, int], dtype: str) -> dict[str, Any]:
    """config.json for the architecture (vocabulary trimmed to the tokenizer's)."""
    with _as_export_error():
        family = families.for_arch(arch)
    eos = specials.get("eos_token_id")
    common = {
        "vocab_size": vocab_size,
        "torch_dtype": dtype,
        "bos_token_id": specials.get("bos_token_id", eos),
        "eos_token_id": eos,
        "use_cache": True,
    }
    if specials.get("pad_token_id") is not None:
        common["pad_token_id"] = specials["pad_token_id"]
    return {**family.hf_config(arch), **common}


def arch_from_hf(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our architecture dict for an HF config of a registered family; anything we cannot compute exactly is an error."""
    from snakellm.models.architecture import resolve

    with _as_export_error():
        family = families.by_model_type(config.get("model_type"), where, config)
        over = family.arch_from_hf(config, where)
    return resolve(None, over)


# ----------------------------------------------------------------------------- weights (torch)


def megatron_tensors(model) -> dict[str, Any]:
    """The model's weights by local-spec name (no ``_extra_state``, TE norm names folded in)."""
    out = {}
    for k, v in model.state_dict().items():
        if v is None or k.endswith("_extra_state") or not hasattr(v, "shape"):
            continue
        for te, local in _TE_NAMES.items():
            if k.endswith(te):
                k = k[: -len(te)] + local
        out[k] = v
    return out


def to_hf(arch: dict[str, Any], m: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """HF state dict (independent contiguous tensors) from megatron tensors: the family's weight table."""
    with _as_export_error():
        return families.for_arch(arch).to_hf(arch, m, vocab_size)


def from_hf(arch: dict[str, Any], hf: dict[str, Any], padded_vocab: int) -> dict[str, Any]:
    """Megatron tensors (local-spec names) from an HF state dict; the vocabulary zero-padded."""
    with _as_export_error():
        return families.for_arch(arch).from_hf(arch, hf, padded_vocab)


def group_to_hf(arch: dict[str, Any], tensors: Any, vocab_size: int, group: int) -> dict[str, Any]:
    """HF tensors of one group: layer ``group``, or (-1) those outside the layers (streaming export)."""
    with _as_export_error():
        return families.for_arch(arch).to_hf(arch, tensors, vocab_size, group=group)


def group_from_hf(arch: dict[str, Any], hf: Any, padded_vocab: int, group: int) -> dict[str, Any]:
    """megatron-core tensors of one group from an HF mapping (a lazy reader; streaming import)."""
    with _as_export_error():
        return families.for_arch(arch).from_hf(arch, hf, padded_vocab, group=group)


# ----------------------------------------------------------------------------- files


def parse_size(text: str | int) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or a plain number."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    for suf, mul in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


def read_hf_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, tensors) of a Hugging Face model directory (safetensors, sharded or not, or pytorch_model.bin)."""
    import torch
    from safetensors.torch import load_file

    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    config = json.loads(cfg_path.read_text())
    tensors: dict[str, Any] = {}
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file():
        tensors = load_file(str(hf_dir / "model.safetensors"))
    elif index.is_file():
        for f in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(str(hf_dir / f)))
    elif (hf_dir / "pytorch_model.bin").is_file():
        tensors = torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ExportError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
    return config, tensors


def _publish_dir(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``tmp`` (a killed export never leaves a directory that looks done)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def export_hf(
    loaded,
    out: str | os.PathLike,
    *,
    max_shard_size: str = "5GB",
    dtype: str = "auto",
    tokenizer_base: Path | None = None,
) -> Path:
    """Write ``out/`` (config.json, generation_config.json, safetensors, tokenizer files) from a loaded model."""
    m = megatron_tensors(loaded.model)
    layers: dict[int, dict[str, Any]] = {}
    outer = {}
    for k, t in m.items():
        if k.startswith("decoder.layers."):
            layers.setdefault(int(k.split(".")[2]), {})[k] = t.detach().cpu()
        else:
            outer[k] = t.detach().cpu()
    groups = iter([outer, *(layers[i] for i in sorted(layers))])
    source = {"source": str(loaded.checkpoint), "iteration": loaded.iteration}
    return write_export(
        loaded.arch,
        groups,
        loaded.tokenizer,
        loaded.padded_vocab_size,
        source,
        out,
        max_shard_size,
        dtype,
        tokenizer_base,
    )


def export_hf_from_checkpoint(
    info: dict[str, Any],
    out: str | os.PathLike,
    *,
    max_shard_size: str = "5GB",
    dtype: str = "auto",
    tokenizer_base: Path | None = None,
    transform: Callable[[Iterator[dict[str, Any]]], Iterator[dict[str, Any]]] | None = None,
    source_extra: dict[str, Any] | None = None,
) -> Path:
    """:func:`export_hf` reading the checkpoint one layer at a time (``info``: ``describe_run``'s).

    ``transform`` rewrites the stream of tensor groups on its way out (``lora merge-hf`` folds an adapter
    in) and ``source_extra`` adds to the provenance recorded with the export.
    """
    from snakellm.export.stream import read_groups

    groups = read_groups(info["checkpoint_dir"], info["iteration"], info["arch"], info["padded_vocab_size"])
    source = {"source": str(info["checkpoint_dir"]), "iteration": info["iteration"], **(source_extra or {})}
    return write_export(
        info["arch"],
        transform(groups) if transform else groups,
        info["tokenizer"],
        info["padded_vocab_size"],
        source,
        out,
        max_shard_size,
        dtype,
        tokenizer_base,
    )


def write_export(
    arch: dict[str, Any],
    groups: Any,
    tok: dict[str, Any],
    padded: int,
    source: dict[str, Any],
    out: str | os.PathLike,
    max_shard_size: str,
    dtype: str,
    tokenizer_base: Path | None,
) -> Path:
    """The HF directory from megatron tensor groups (outer, then each layer), written shard by shard."""
    import torch

    from snakellm.export.hf_tokenizer import export_tokenizer
    from snakellm.export.stream import write_hf_weights

    hf_family(arch)
    vocab = int(tok.get("vocab_size") or padded)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specials = (
        export_tokenizer(tok, tmp, base=tokenizer_base, model_max_length=arch["seq_length"]) if tok.get("kind") else {}
    )
    tdt = (
        None
        if dtype == "auto"
        else {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    )
    _, dt = write_hf_weights(groups, arch, vocab, tmp, parse_size(max_shard_size), tdt)
    config = hf_config(arch, vocab, specials, dt)
    write_json(tmp / "config.json", config)
    gen = {"_from_model_config": True, "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if "pad_token_id" in config:
        gen["pad_token_id"] = config["pad_token_id"]
    write_json(tmp / "generation_config.json", gen)
    write_json(tmp / "snakellm.json", {**source, "arch": arch, "padded_vocab_size": padded})
    _publish_dir(tmp, out)
    return out


def build_for_import(arch: dict[str, Any], padded_vocab: int, device: str = "cpu"):
    """An empty megatron-core GPTModel (local spec, as every checkpoint loads) in a single process."""
    from snakellm.launch.runtime import ensure_single_process
    from snakellm.models.build import build_model

    dev = ensure_single_process(device)
    model, _ = build_model(arch, padded_vocab, device=str(dev), fused_loss="eager", use_te=False)
    return model


def import_hf(hf_dir: str | os.PathLike, dest: str | os.PathLike, *, make_vocab_size_divisible_by: int = 128) -> dict:
    """An HF GPT-2/Llama/Qwen2/Mistral directory -> a model-only checkpoint under ``dest`` (a run dir).

    safetensors (one file or sharded) convert in bounded memory, one layer at a time, in the
    checkpoint's own dtype (:func:`snakellm.export.stream.import_streaming`); a ``pytorch_model.bin``
    is read whole. Returns the import's summary.
    """
    from snakellm.export.hf_tokenizer import import_tokenizer
    from snakellm.models.architecture import padded_vocab_size

    hf_dir, dest = Path(hf_dir), Path(dest)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    config = json.loads(cfg_path.read_text())
    arch = arch_from_hf(config, str(cfg_path))
    arch["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    vocab = int(config["vocab_size"])
    padded = padded_vocab_size(vocab, arch)
    tok = import_tokenizer(hf_dir, dest / "tokenizer")
    if tok["vocab_size"] > vocab:
        raise ExportError(f"{hf_dir}: the tokenizer has {tok['vocab_size']} tokens, the model's vocab_size is {vocab}")
    tok["vocab_size"] = vocab  # the model's (HF embeddings may be larger than the tokenizer)
    extra = {"imported_from": str(hf_dir)}
    if (hf_dir / "model.safetensors").is_file() or (hf_dir / "model.safetensors.index.json").is_file():
        from snakellm.export.stream import import_streaming

        import_streaming(hf_dir, arch, padded, dest, tok, extra)
    else:
        _import_in_memory(hf_dir, arch, padded, dest, tok, extra)
    return {"arch": arch, "padded_vocab_size": padded, "tokenizer": tok, "source": str(hf_dir)}


def _import_in_memory(
    hf_dir: Path, arch: dict[str, Any], padded: int, dest: Path, tok: dict[str, Any], extra: dict[str, Any]
) -> None:
    """A ``pytorch_model.bin`` (one pickle: no tensor-by-tensor reading) converted whole, in fp32."""
    import torch

    from snakellm.models.loading import save_model_checkpoint

    _, tensors = read_hf_dir(hf_dir)
    msd = from_hf(arch, {k: v.float() for k, v in tensors.items()}, padded)
    model = build_for_import(arch, padded)
    expected = megatron_tensors(model)
    missing, unexpected = sorted(set(expected) - set(msd)), sorted(set(msd) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"{hf_dir}: weights do not fit the architecture (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    with torch.no_grad():
        for k, t in expected.items():
            if t.shape != msd[k].shape:
                raise ExportError(
                    f"{hf_dir}: {k} has shape {tuple(msd[k].shape)}, the architecture needs {tuple(t.shape)}"
                )
            t.copy_(msd[k])
    save_model_checkpoint(dest, model, arch, padded, tok, 0, extra=extra)


# ----------------------------------------------------------------------------- command lines


def tokenizer_from_blend(blend: str | os.PathLike) -> dict:
    """The tokenizer block of a blend.json (what a run was trained with)."""
    p = Path(blend)
    try:
        return json.loads(p.read_text())["tokenizer"]
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(f"{p}: no tokenizer block: {e}") from None
