"""Mixtral (8x7B shape): Mistral's attention and a mixture-of-experts MLP in every layer.

Hugging Face class: ``MixtralForCausalLM``. Each layer's MLP is megatron-core's own MoE layer
(its router, the alltoall token dispatcher and one SwiGLU MLP per expert, built from the local
spec: see :mod:`snakellm.models.moe`): ``block_sparse_moe.gate`` is the router, expert ``e``'s
``w1`` (gate), ``w3`` (up) and ``w2`` (down) are ``mlp.experts.local_experts.{e}.linear_fc1 =
[gate; up]`` and ``linear_fc2``. Mixtral's routing is a softmax over all experts, the top k of
it, renormalised: the same as megatron-core's softmax over the top-k logits
(``moe_norm_topk_prob: true``). The files hold one tensor per expert (what ``save_pretrained``
writes; transformers fuses them when it loads), so import and export stream a layer with its
experts at a time. The sliding window is Mistral's (``seq_length <= sliding_window``).
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families import llama, mistral
from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight
from snakellm.models.moe import moe_refuses

L = "decoder.layers.{i}."
P = "model.layers.{i}."
X = L + "mlp.experts.local_experts.{e}."
Y = P + "block_sparse_moe.experts.{e}."

WEIGHTS = (
    *(w for w in mistral.WEIGHTS if ".mlp." not in w.ours),
    Weight(L + "mlp.router.weight", (P + "block_sparse_moe.gate.weight",)),
    Weight(X + "linear_fc1.weight", (Y + "w1.weight", Y + "w3.weight"), rows="gate_up"),
    Weight(X + "linear_fc2.weight", (Y + "w2.weight",)),
)
HF_KEYS = (
    *(k for k in mistral.HF_KEYS if k.hf != "intermediate_size"),
    HFKey("intermediate_size", "moe_ffn_hidden_size"),
    HFKey("num_local_experts", "num_experts"),
    HFKey("num_experts_per_tok", "moe_router_topk"),
    HFKey("router_aux_loss_coef", "moe_aux_loss_coeff", default=0.0),
)


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("router_jitter_noise"):
        raise FamilyError(
            f"{where}: router_jitter_noise {config['router_jitter_noise']}: megatron-core's router has no "
            "input jitter (set it to 0.0)"
        )
    out = mistral._import_extra(config, where)
    # every layer is a MoE layer: the dense width is the experts' (it sizes nothing else)
    return {**out, "ffn_hidden_size": config.get("intermediate_size"), "moe_norm_topk_prob": True}


def _refuses(arch: Arch) -> str | None:
    why = mistral._refuses(arch)
    if why:
        return why.replace("MistralForCausalLM", "MixtralForCausalLM")
    return moe_refuses(arch, "MixtralForCausalLM", norm_topk=True)


FAMILY = Family(
    name="mixtral",
    summary="Mixtral: Mistral's attention, a mixture of experts (softmax top-k, renormalised) in every layer",
    defaults={
        **llama.FAMILY.defaults,
        "num_experts": 8,
        "moe_router_topk": 2,
        "moe_score_function": "softmax",
        "moe_norm_topk_prob": True,
        "rotary_base": 1000000,
    },
    presets={
        "tiny-mixtral": dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=96,
            moe_ffn_hidden_size=96,
            num_experts=4,
            moe_router_topk=2,
            seq_length=128,
        ),
        # Mixtral-8x7B-v0.1: 32 layers, d=4096, 32 heads in 8 KV groups, 8 experts of SwiGLU 14336, top-2;
        # vocabulary 32,000; RoPE base 1e6 (46.7B parameters, 12.9B active)
        "mixtral-8x7b": dict(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            moe_ffn_hidden_size=14336,
            num_experts=8,
            moe_router_topk=2,
            seq_length=4096,
            rotary_base=1000000,
        ),
    },
    features=llama.FAMILY.features,
    hf_model_type="mixtral",
    hf_architecture="MixtralForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    arch_keys={"sliding_window": None},
    hf_refuses=_refuses,
    hf_export_extra=lambda arch: {
        **mistral.FAMILY.hf_export_extra(arch),  # Mistral's attention keys
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    },
    hf_import_extra=_import_extra,
    megatron_config=mistral.FAMILY.megatron_config,
    nemo_refuses=lambda arch: "a mixture-of-experts model (num_experts): snakellm's .nemo export is dense only",
)
