"""A preallocated KV cache: one fixed row of ``max_len`` slots per batch row.

Why static: the decode step must have the same tensor addresses and shapes at
every step to be captured once in a CUDA graph and replayed; a cache that grows
(``torch.cat``) or is allocated per request cannot be. Each batch row holds one
request's keys and values at positions ``0..len-1`` (no left padding: rows start
at 0 and differ only in length), plus one spare slot at ``max_len`` where a row
that has already finished may write during the step it leaves the batch.

The row count comes from a memory budget: a fraction of the device memory free
after loading the model, or a number of bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from snakellm.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(value: str | float | int) -> tuple[str, float]:
    """``"0.9"`` -> ("fraction", 0.9); ``"8GB"``/``8e9``/``"512MiB"`` -> ("bytes", n). ConfigError names the key."""
    text = str(value).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"kv_cache_memory: expected a fraction (0.9) or bytes (8GB, 512MiB), got {value!r}")
    number = float(m.group(1))
    if m.group(2) == "" and 0 < number <= 1:
        return "fraction", number
    if number * _UNITS[m.group(2)] < 1:
        raise ConfigError(f"kv_cache_memory: must be a fraction in (0, 1] or a positive number of bytes, got {value!r}")
    return "bytes", number * _UNITS[m.group(2)]


def available_bytes(device: Any) -> int:
    """Memory free for the cache now: the GPU's free memory, or the host's available memory on the CPU."""
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass
class CacheShape:
    layers: int
    groups: int
    head_dim: int
    max_len: int
    itemsize: int

    def row_bytes(self) -> int:
        """Bytes one batch row takes: keys and values of every layer, ``max_len`` + 1 (the spare) slots."""
        return 2 * self.layers * self.groups * (self.max_len + 1) * self.head_dim * self.itemsize


def rows_for_budget(shape: CacheShape, budget: str | float | int, max_batch: int, device: Any) -> int:
    """How many rows the budget holds (at most ``max_batch``); ConfigError when it holds none."""
    kind, amount = parse_budget(budget)
    nbytes = amount * available_bytes(device) if kind == "fraction" else amount
    rows = min(max_batch, int(nbytes // shape.row_bytes()))
    if rows < 1:
        raise ConfigError(
            f"kv_cache_memory: {budget} ({nbytes / 2**20:.1f} MiB) holds no row of {shape.max_len} tokens "
            f"({shape.row_bytes() / 2**20:.1f} MiB each): raise kv_cache_memory or lower max_seq_len"
        )
    return rows


class StaticKVCache:
    """Keys and values ``[layers, 2, rows, groups, max_len + 1, head_dim]``, allocated once."""

    def __init__(self, shape: CacheShape, rows: int, dtype: Any, device: Any) -> None:
        import torch

        self.shape = shape
        self.rows = rows
        self.max_len = shape.max_len
        self.data = torch.zeros(
            (shape.layers, 2, rows, shape.groups, shape.max_len + 1, shape.head_dim), dtype=dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def keys(self, layer: int) -> Any:
        return self.data[layer, 0]

    def values(self, layer: int) -> Any:
        return self.data[layer, 1]
