"""A Hugging Face model directory of a preset's shape with random weights (``snakellm random-hf``).

What the chain at 7-8B starts from when the real weights are not wanted (or not allowed to be
downloaded): speed, memory and every format of the chain depend on the shape, not on the values.
The tensors are made one layer at a time on megatron-core's names and shapes (the meta model that
the streaming import builds), then written by the same streaming writer as ``export-hf``
(:func:`snakellm.export.hf.write_export`: safetensors shards, config.json, generation_config.json,
the tokenizer files), so memory stays at one layer (about 0.9 GB of float32 draws at 8B) and the
directory is exactly what ``import-hf`` and transformers read. The tokenizer is GPT-2's BPE (the
repository ships its vocab.json and merges.txt): the shape keeps the preset's layers, widths and
heads; the vocabulary is GPT-2's 50,257 tokens.

Values: linear weights and embeddings uniform with standard deviation ``std`` (0.02, megatron's
init), norms 1, biases 0; seeded, so a directory is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError

GPT2_FILES = ("vocab.json", "merges.txt")
GPT2_VOCAB = 50257


class RandomHfError(UsageError, ValueError):
    pass


def gpt2_tokenizer_block(tokenizer_dir: Path) -> dict[str, Any]:
    """Our tokenizer block for GPT-2's BPE files in ``tokenizer_dir`` (an error naming a missing one)."""
    for f in GPT2_FILES:
        if not (tokenizer_dir / f).is_file():
            raise RandomHfError(f"tokenizer_dir: {tokenizer_dir / f} not found (GPT-2's {' and '.join(GPT2_FILES)})")
    return {
        "kind": "gpt2-bpe",
        "name": "gpt2",
        "vocab_size": GPT2_VOCAB,
        "eod_id": 50256,
        "eod_token": "<|endoftext|>",
        "files": {
            "vocab_file": str((tokenizer_dir / "vocab.json").resolve()),
            "merges_file": str((tokenizer_dir / "merges.txt").resolve()),
        },
    }


def random_groups(model: Any, seed: int, std: float, dtype: Any) -> Iterator[dict[str, Any]]:
    """megatron-core tensors of ``model`` (a meta model), made on the CPU: the outer ones, then each layer."""
    import torch

    from snakellm.export.hf import megatron_tensors

    shapes = {k: tuple(v.shape) for k, v in megatron_tensors(model).items()}
    outer = sorted(k for k in shapes if not k.startswith("decoder.layers."))
    layers: dict[int, list[str]] = {}
    for k in shapes:
        if k.startswith("decoder.layers."):
            layers.setdefault(int(k.split(".")[2]), []).append(k)
    bound = std * math.sqrt(3.0)  # uniform on [-b, b] has standard deviation b / sqrt(3)

    def make(name: str, index: int) -> Any:
        shape = shapes[name]
        if name.endswith("bias"):
            return torch.zeros(shape, dtype=dtype)
        if len(shape) == 1:  # norm weights (RMSNorm / LayerNorm)
            return torch.ones(shape, dtype=dtype)
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g).to(dtype)

    names = outer + [k for i in sorted(layers) for k in sorted(layers[i])]
    index = {k: i for i, k in enumerate(names)}
    yield {k: make(k, index[k]) for k in outer}
    for i in sorted(layers):
        yield {k: make(k, index[k]) for k in sorted(layers[i])}


def write_random_hf(
    preset: str,
    out: str | Path,
    *,
    tokenizer_dir: str | Path,
    seed: int = 0,
    std: float = 0.02,
    max_shard_size: str = "5GB",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write ``out/``: a transformers model directory of ``preset``'s shape, random weights (bf16)."""
    import torch

    from snakellm import models
    from snakellm.export.hf import hf_family, write_export
    from snakellm.export.stream import meta_model

    try:
        arch = models.resolve(preset, overrides or {})
    except (KeyError, ValueError) as e:
        raise RandomHfError(f"preset: {e}") from None
    hf_family(arch)  # a shape transformers computes exactly, else an error naming it
    tok = gpt2_tokenizer_block(Path(tokenizer_dir))
    padded = models.padded_vocab_size(tok["vocab_size"], arch)
    model = meta_model(arch, padded, torch.bfloat16)
    source = {"source": f"random weights of the {preset} preset (snakellm random-hf)", "seed": seed, "std": std}
    groups = random_groups(model, seed, std, torch.bfloat16)
    return write_export(arch, groups, tok, padded, source, out, max_shard_size, "bfloat16", None)
