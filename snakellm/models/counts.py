"""Parameter and FLOP counts from the shapes alone (torch-free).

MFU in the training logs and the benchmark scripts is computed from these, and
the trainer checks :func:`param_count` against the model megatron-core built.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families.base import head_dim


def param_count(cfg: dict[str, Any], vocab: int, active: bool = False) -> int:
    """Number of distinct parameters (tied embeddings counted once), from the shapes alone.

    A mixture of experts counts every expert, or with ``active`` the ``moe_router_topk`` experts
    (and the router) a token runs through: what its FLOPs and a decode step's weight reads scale with.
    """
    h, L, f = cfg["hidden_size"], cfg["num_layers"], cfg["ffn_hidden_size"]
    d = head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * d, cfg["num_query_groups"] * d  # q = h unless the head size is its own
    b = cfg["bias"]
    qkv_b = cfg.get("qkv_bias", b)
    norm = 2 * h if cfg["normalization"] == "LayerNorm" else h
    qk_norm = 2 * d if cfg.get("qk_norm") else 0  # Qwen3's RMSNorm over each query and key head
    attn = h * (q + 2 * kv) + (q + 2 * kv if qkv_b else 0) + q * h + (h if b else 0) + qk_norm
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
    attention's score and value products at full (non-causal) cost, ``h`` being the query heads'
    width (``heads x kv_channels``: the model width unless the head size is its own).
    """
    width = cfg["num_attention_heads"] * head_dim(cfg)
    return 6.0 * param_count(cfg, vocab, active=True) + 12.0 * cfg["num_layers"] * width * cfg["seq_length"]
