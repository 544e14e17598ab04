"""The language-model loss: per-token cross-entropy from megatron's logits layout."""

from __future__ import annotations

from typing import Any


def cross_entropy(logits: Any, labels: Any) -> Any:
    """Per-token loss [b, s] from logits [s, b, V] (any float dtype) and labels [b, s].

    One fused pass when compiled: the logits are read once in their own dtype
    and upcast in registers, never materialised in fp32 the way megatron-core's
    unfused ``vocab_parallel_cross_entropy`` does (several full fp32 copies of
    a [tokens, vocab] tensor: the biggest single cost at GPT-2 scale).
    """
    import torch.nn.functional as F

    s, b, v = logits.shape
    loss = F.cross_entropy(logits.reshape(s * b, v).float(), labels.t().reshape(s * b), reduction="none")
    return loss.view(s, b).t()
