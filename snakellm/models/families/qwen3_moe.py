"""Qwen3-MoE (30B-A3B shape): Qwen3's attention (QK-norm, its own head size) and a mixture of experts in every layer.

Hugging Face class: ``Qwen3MoeForCausalLM``. The MLP is megatron-core's MoE layer (see
:mod:`snakellm.models.moe`): ``mlp.gate`` is the router, expert ``e``'s ``gate_proj``, ``up_proj``
and ``down_proj`` are ``mlp.experts.local_experts.{e}.linear_fc1 = [gate; up]`` and ``linear_fc2``
(one tensor per expert in the files, as ``save_pretrained`` writes them). Routing: a softmax over
all experts, its top k, renormalised when ``norm_topk_prob`` (Qwen3-30B-A3B: true; megatron-core's
softmax over the top-k logits) or not (megatron-core's ``moe_router_pre_softmax``). Every layer is
sparse: ``decoder_sparse_step`` other than 1 or ``mlp_only_layers`` (dense layers among the MoE
ones) are refused with the key. The number of experts is ``num_experts`` in the published configs
and ``num_local_experts`` in what transformers 5 writes: import reads either.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families import qwen3
from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight
from snakellm.models.moe import moe_refuses

L, P = qwen3.L, qwen3.P
X = L + "mlp.experts.local_experts.{e}."
Y = P + "mlp.experts.{e}."

_DENSE = [w for w in qwen3.WEIGHTS if ".mlp." not in w.ours]
_LAST = next(i for i, w in enumerate(_DENSE) if not w.per_layer and i > 0)  # the final norm: after the layers
WEIGHTS = (
    *_DENSE[:_LAST],
    Weight(L + "mlp.router.weight", (P + "mlp.gate.weight",)),
    Weight(X + "linear_fc1.weight", (Y + "gate_proj.weight", Y + "up_proj.weight"), rows="gate_up"),
    Weight(X + "linear_fc2.weight", (Y + "down_proj.weight",)),
    *_DENSE[_LAST:],
)
HF_KEYS = (
    *qwen3.HF_KEYS,
    HFKey("moe_intermediate_size", "moe_ffn_hidden_size"),
    HFKey("num_local_experts", "num_experts", default=None),  # or num_experts (the hook reads it)
    HFKey("num_experts_per_tok", "moe_router_topk"),
    HFKey("norm_topk_prob", "moe_norm_topk_prob", default=False, to_hf=bool, from_hf=bool),
    HFKey("router_aux_loss_coef", "moe_aux_loss_coeff", default=0.0),
)


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("decoder_sparse_step", 1) != 1:
        raise FamilyError(f"{where}: decoder_sparse_step {config['decoder_sparse_step']}: every layer must be MoE (1)")
    if config.get("mlp_only_layers"):
        raise FamilyError(f"{where}: mlp_only_layers {config['mlp_only_layers']}: dense layers among the MoE ones")
    out = qwen3._import_extra(config, where)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        raise FamilyError(f"{where}: num_experts (or num_local_experts) is missing (qwen3_moe config)")
    return {**out, "num_experts": experts}


def _refuses(arch: Arch) -> str | None:
    why = qwen3._refuses(arch)
    if why:
        return why.replace("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    return moe_refuses(arch, "Qwen3MoeForCausalLM", norm_topk=None)


def _export_extra(arch: Arch) -> dict[str, Any]:
    out = qwen3.FAMILY.hf_export_extra(arch)
    return {**out, "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False}


FAMILY = Family(
    name="qwen3_moe",
    summary="Qwen3-MoE: Qwen3's attention, a mixture of experts (softmax top-k, renormalised or not) in every layer",
    defaults={
        **qwen3.FAMILY.defaults,
        "num_experts": 128,
        "moe_router_topk": 8,
        "moe_score_function": "softmax",
        "moe_norm_topk_prob": True,
    },
    presets={
        "tiny-qwen3-moe": dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=32,
            ffn_hidden_size=96,
            moe_ffn_hidden_size=32,
            num_experts=8,
            moe_router_topk=2,
            seq_length=128,
            tie_embeddings=False,
        ),
        # Qwen3-30B-A3B: 48 layers, d=2048, 32 heads of 128 in 4 KV groups, 128 experts of SwiGLU 768, top-8
        # renormalised, QK-norm, untied, RoPE base 1e6; vocabulary 151,936 (30.5B parameters, 3.3B active)
        "qwen3-30b-a3b": dict(
            num_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            ffn_hidden_size=6144,
            moe_ffn_hidden_size=768,
            num_experts=128,
            moe_router_topk=8,
            seq_length=4096,
            tie_embeddings=False,
        ),
    },
    features=qwen3.FAMILY.features,
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    arch_keys=qwen3.FAMILY.arch_keys,
    hf_refuses=_refuses,
    hf_export_extra=_export_extra,
    hf_import_extra=_import_extra,
    megatron_config=qwen3.FAMILY.megatron_config,
    nemo_refuses=lambda arch: "a mixture-of-experts model (num_experts): snakellm's .nemo export is dense only",
)
