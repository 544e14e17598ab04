"""Parameter and FLOP counts from the shapes alone (torch-free).

MFU in the training logs and the benchmark scripts is computed from these, and
the trainer checks :func:`param_count` against the model megatron-core built.
"""

from __future__ import annotations

from typing import Any


def param_count(cfg: dict[str, Any], vocab: int, active: bool = False) -> int:
    """Number of distinct parameters (tied embeddings counted once), from the shapes alone.

    A mixture of experts counts every expert, or with ``active`` the ``moe_router_topk`` experts
    (and the router) a token runs through: what its FLOPs and a decode step's weight reads scale with.
    """
    h, L, f = cfg["hidden_size"], cfg["num_layers"], cfg["ffn_hidden_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_query_groups"]
    b = cfg["bias"]
    qkv_b = cfg.get("qkv_bias", b)
    norm = 2 * h if cfg["normalization"] == "LayerNorm" else h
    attn = h * (h + 2 * kv) + (h + 2 * kv if qkv_b else 0) + h * h + (h if b else 0)
    mlp_in = 2 * f if cfg["activation"] == "swiglu" else f
    mlp = h * mlp_in + (mlp_in if b else 0) + f * h + (h if b else 0)
    if cfg.get("num_experts"):
        from snakellm.models.moe import mlp_params

        mlp = mlp_params(cfg, active=active)
    layer = attn + mlp + 2 * norm
    emb = vocab * h + (cfg["seq_length"] * h if cfg["position_embedding"] == "learned" else 0)
    head = 0 if cfg["tie_embeddings"] else vocab * h
    return L * layer + emb + norm + head


def flops_per_token(cfg: dict[str, Any], vocab: int) -> float:
    """Training FLOPs per token: 6 N + 12 L h s (the formula llm.c and PaLM's MFU use).

    N is the parameter count with tied embeddings counted once (a mixture of experts: the active
    parameters, as Megatron-Bridge's and torchtitan's MoE MFU count them); the second term is
    attention's score and value products at full (non-causal) cost.
    """
    return (
        6.0 * param_count(cfg, vocab, active=True) + 12.0 * cfg["num_layers"] * cfg["hidden_size"] * cfg["seq_length"]
    )
