"""Mistral (7B shape): Llama's layout, no biases, and a ``sliding_window`` over the keys.

Hugging Face class: ``MistralForCausalLM``. Attention within a window of ``w`` keys equals full
causal attention while the sequence is at most ``w`` tokens, which is what snakellm computes: the
window is an architecture key (``sliding_window``, null for none) and every build checks
``seq_length <= sliding_window``; a config whose ``max_position_embeddings`` exceeds its window is
refused with the reason (set ``max_position_embeddings`` to the window to import a model exact up
to it). NeMo 1.x has no window key; the .nemo records ``sliding_window`` for our import (NeMo's
``TransformerConfig`` takes only its own field names) and computes the same up to it.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families import llama
from snakellm.models.families.base import Arch, Family, FamilyError, HFKey

WEIGHTS = tuple(w for w in llama.WEIGHTS if not w.ours.endswith(".bias"))
HF_KEYS = (
    *(k for k in llama.HF_KEYS if k.hf not in ("attention_bias", "mlp_bias")),
    HFKey("sliding_window", "sliding_window", default=None),
)


def _too_long(arch: Arch) -> str | None:
    w, seq = arch["sliding_window"], arch["seq_length"]
    if w is not None and seq > w:
        return (
            f"sliding_window {w} < seq_length {seq}: snakellm attends to the whole sequence, which equals "
            f"the windowed attention only up to {w} tokens; use seq_length <= {w}"
        )
    return None


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise FamilyError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    h, n = config.get("hidden_size"), config.get("num_attention_heads")
    if h and n and config.get("head_dim") not in (None, h // n):
        raise FamilyError(f"{where}: head_dim {config['head_dim']} != hidden_size / heads ({h // n})")
    w, seq = config.get("sliding_window"), config.get("max_position_embeddings")
    if w is not None and seq is not None and seq > w:
        raise FamilyError(
            f"{where}: sliding_window {w} < max_position_embeddings {seq}: snakellm computes full attention, "
            f"exact only up to {w} tokens (set max_position_embeddings to {w} to import it exact up to there)"
        )
    from snakellm.models.families import llama3

    rope = llama3.rope_parameters(config)
    if rope["rope_type"] != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise FamilyError(f"{where}: rope parameters {rope} are not supported (plain RoPE only)")
    if "rope_theta" in rope and config.get("rope_theta") is None:
        return {"rotary_base": llama._theta(rope["rope_theta"])}
    return {}


def _refuses(arch: Arch) -> str | None:
    if arch["bias"]:
        return "bias: true: MistralForCausalLM has no biases"
    return _too_long(arch)


def _megatron_config(arch: Arch) -> dict[str, Any]:
    why = _too_long(arch)
    if why:
        raise FamilyError(why)
    return {}


FAMILY = Family(
    name="mistral",
    summary="Mistral: Llama's layout with a sliding window (seq_length <= window)",
    defaults={**llama.FAMILY.defaults},
    presets={},
    features=llama.FAMILY.features,
    hf_model_type="mistral",
    hf_architecture="MistralForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    arch_keys={"sliding_window": None},
    hf_refuses=_refuses,
    hf_export_extra=lambda arch: {
        "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
        "hidden_act": "silu",
        "attention_dropout": 0.0,
    },
    hf_import_extra=_import_extra,
    megatron_config=_megatron_config,
    nemo_extra=lambda arch: {"sliding_window": arch["sliding_window"]},
    nemo_import_extra=lambda cfg, where: {"sliding_window": cfg.get("sliding_window")},
    nemo_claims=lambda cfg: cfg.get("sliding_window") is not None,
)
