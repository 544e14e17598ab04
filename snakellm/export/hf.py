"""Hugging Face export and import: megatron-core GPTModel <-> GPT2LMHeadModel / LlamaForCausalLM.

Weight mapping (megatron-core local-spec names; TE-spec ``layer_norm_*`` names are
folded into them first):

* ``linear_qkv`` rows are grouped per query group as ``[q (heads_per_group x d),
  k (d), v (d)]``; HF keeps q, k, v apart (Llama) or as ``[q; k; v]`` over all
  heads (GPT-2's ``c_attn``).
* ``linear_fc1`` of a SwiGLU MLP is ``cat(gate, up)``; Llama has ``gate_proj`` and ``up_proj``.
* GPT-2's ``Conv1D`` stores ``[in, out]``: every GPT-2 linear weight is transposed.
* The embedding (and an untied output layer) is padded to a multiple of
  ``make_vocab_size_divisible_by``: rows past the tokenizer's vocabulary are dropped on export
  and zero-filled on import.
* Tied embeddings: no ``lm_head.weight`` in the file, ``tie_word_embeddings: true``.

Which HF class a model maps to is decided from the architecture alone
(:func:`hf_family`), before any weights are read, so an unsupported combination
is an error before work starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snakellm.io.atomic import write_json
from snakellm.io.log import log


class ExportError(ValueError):
    """A model that has no faithful Hugging Face equivalent, or a malformed HF directory."""


_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


# ----------------------------------------------------------------------------- architecture (no torch)


def hf_family(arch: dict[str, Any]) -> str:
    """ "gpt2", "llama", "qwen2" or "mistral": the HF class that computes exactly what this architecture does."""
    gpt2 = dict(position_embedding="learned", normalization="LayerNorm", activation="gelu")
    llama = dict(position_embedding="rope", normalization="RMSNorm", activation="swiglu")
    for family, want in (("gpt2", gpt2), ("llama", llama)):
        if all(arch.get(k) == v for k, v in want.items()):
            if family == "gpt2" and arch["num_query_groups"] != arch["num_attention_heads"]:
                raise ExportError(
                    f"GPT-2 style with {arch['num_query_groups']} query groups for {arch['num_attention_heads']} heads: "
                    "GPT2LMHeadModel has no grouped-query attention"
                )
            if family == "gpt2" and (arch.get("sliding_window") or arch.get("rope_scaling_factor")):
                raise ExportError("GPT-2 style with a sliding window or RoPE scaling: GPT2LMHeadModel has neither")
            if family == "gpt2" and arch.get("qkv_bias", arch["bias"]) != arch["bias"]:
                raise ExportError("GPT-2 style with q/k/v-only biases: GPT2LMHeadModel biases every linear or none")
            return _llama_variant(arch) if family == "llama" else family
    got = ", ".join(f"{k}={arch.get(k)}" for k in gpt2)
    raise ExportError(
        f"no Hugging Face class computes this model ({got}): GPT2LMHeadModel needs learned positions, LayerNorm, "
        "gelu; LlamaForCausalLM needs rope, RMSNorm, swiglu"
    )


def _llama_variant(arch: dict[str, Any]) -> str:
    """LlamaForCausalLM, or Qwen2 (q/k/v-only biases) or Mistral (a sliding window) where Llama has no key."""
    window, qkv_only = arch.get("sliding_window"), arch.get("qkv_bias") and not arch["bias"]
    if window is not None and (qkv_only or arch["bias"]):
        raise ExportError("a sliding window with biases: MistralForCausalLM has no biases, Qwen2 no global window")
    if window is not None:
        return "mistral"
    return "qwen2" if qkv_only else "llama"


def hf_config(arch: dict[str, Any], vocab_size: int, specials: dict[str, int], dtype: str) -> dict[str, Any]:
    """config.json for the architecture (vocabulary trimmed to the tokenizer's)."""
    family = hf_family(arch)
    h, n = arch["hidden_size"], arch["num_attention_heads"]
    eos = specials.get("eos_token_id")
    common = {
        "vocab_size": vocab_size,
        "tie_word_embeddings": bool(arch["tie_embeddings"]),
        "torch_dtype": dtype,
        "bos_token_id": specials.get("bos_token_id", eos),
        "eos_token_id": eos,
        "use_cache": True,
    }
    if specials.get("pad_token_id") is not None:
        common["pad_token_id"] = specials["pad_token_id"]
    if family == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **common,
            "n_layer": arch["num_layers"],
            "n_embd": h,
            "n_head": n,
            "n_inner": arch["ffn_hidden_size"],
            "n_positions": arch["seq_length"],
            "n_ctx": arch["seq_length"],
            "activation_function": "gelu",  # exact erf GeLU, as megatron-core's F.gelu (not GPT-2's gelu_new)
            "layer_norm_epsilon": arch["layernorm_epsilon"],
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": arch["init_method_std"],
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    return _llama_like_config(arch, family, common)


def _llama_like_config(arch: dict[str, Any], family: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM."""
    from snakellm.models import rope

    h, n = arch["hidden_size"], arch["num_attention_heads"]
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    cfg = {
        "architectures": [cls],
        "model_type": family,
        **common,
        "num_hidden_layers": arch["num_layers"],
        "hidden_size": h,
        "num_attention_heads": n,
        "num_key_value_heads": arch["num_query_groups"],
        "head_dim": h // n,
        "intermediate_size": arch["ffn_hidden_size"],
        "max_position_embeddings": arch["seq_length"],
        "rms_norm_eps": arch["layernorm_epsilon"],
        "rope_theta": float(arch["rotary_base"]),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": arch["init_method_std"],
    }
    if rope.scaled(arch):
        cfg["rope_scaling"] = {"rope_type": "llama3", **{hf: arch[k] for k, hf in rope.LLAMA3_KEYS.items()}}
    if family == "llama":
        cfg.update(attention_bias=bool(arch["bias"]), mlp_bias=bool(arch["bias"]), pretraining_tp=1)
    elif family == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=arch["num_layers"])
    else:
        cfg["sliding_window"] = arch["sliding_window"]
    return cfg


def arch_from_hf(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our architecture for an HF GPT-2, Llama, Qwen2 or Mistral config; what we cannot compute is an error."""
    from snakellm.models.architecture import resolve

    mt = config.get("model_type")
    if mt == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act != "gelu":
            raise ExportError(
                f"{where}: activation_function {act!r}: snakellm's GPT-2 style computes the exact GeLU ('gelu') only"
            )
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
            raise ExportError(f"{where}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        h = config["n_embd"]
        over = dict(
            style="gpt2",
            num_layers=config["n_layer"],
            hidden_size=h,
            num_attention_heads=config["n_head"],
            ffn_hidden_size=config.get("n_inner") or 4 * h,
            seq_length=config["n_positions"],
            layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=config.get("tie_word_embeddings", True),
            init_method_std=config.get("initializer_range", 0.02),
        )
    elif mt in ("llama", "qwen2", "mistral"):
        over = _llama_like_from_hf(config, where, mt)
    else:
        raise ExportError(f"{where}: model_type {mt!r}: import supports gpt2, llama, qwen2 and mistral")
    from snakellm.models.architecture import ModelConfigError

    try:
        return resolve(None, over)
    except ModelConfigError as e:
        raise ExportError(f"{where}: {e}") from None


def _rope_from_hf(config: dict[str, Any], where: str) -> dict[str, Any]:
    """rotary_base and Llama 3.x scaling keys from ``rope_scaling`` / ``rope_parameters`` (v4 and v5 names)."""
    from snakellm.models.rope import LLAMA3_KEYS

    rs = dict(config.get("rope_scaling") or {})
    rp = dict(config.get("rope_parameters") or {})
    params = {**rp, **rs}
    kind = params.pop("rope_type", params.pop("type", "default"))
    base = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    if float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ExportError(f"{where}: partial_rotary_factor {config.get('partial_rotary_factor')}: full rotary only")
    out: dict[str, Any] = {"rotary_base": int(base) if float(base).is_integer() else base}
    if kind == "default":
        wanted: dict[str, str] = {}
    elif kind == "llama3":
        wanted = LLAMA3_KEYS
    else:
        raise ExportError(f"{where}: rope_type {kind!r} ({rs or rp}) is not supported (default and llama3 only)")
    unknown = sorted(set(params) - set(wanted.values()))
    if unknown:
        raise ExportError(f"{where}: rope parameter {unknown[0]}={params[unknown[0]]!r} is not supported for {kind}")
    for ours, theirs in wanted.items():
        if theirs not in params:
            raise ExportError(f"{where}: rope_type llama3 needs {theirs}")
        out[ours] = params[theirs]
    return out


def _llama_like_from_hf(config: dict[str, Any], where: str, mt: str) -> dict[str, Any]:
    """Architecture keys of a Llama, Qwen2 or Mistral config (the Llama layout with variations)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    h, n = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, h // n):
        raise ExportError(f"{where}: head_dim {config['head_dim']} != hidden_size / heads ({h // n})")
    if int(config.get("pretraining_tp") or 1) != 1:
        raise ExportError(f"{where}: pretraining_tp {config['pretraining_tp']}: only 1 is supported")
    bias = qkv_bias = False
    window = None
    if mt == "llama":
        if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", False)):
            raise ExportError(f"{where}: attention_bias and mlp_bias differ; megatron-core biases all linears or none")
        bias = qkv_bias = bool(config.get("attention_bias"))
    elif mt == "qwen2":
        qkv_bias = True  # Qwen2's q, k, v projections always have biases, o and the MLP never
        if config.get("use_sliding_window"):
            raise ExportError(f"{where}: use_sliding_window true is not supported (per-layer windows)")
    else:  # mistral: the Llama layout, no biases, one window for every layer
        window = config.get("sliding_window")
    seq = config["max_position_embeddings"]
    if window is not None and window < seq:
        # attention over at most `window` tokens is the full causal attention: exact up to there
        log(f"{where}: sliding_window {window} < max_position_embeddings {seq}: seq_length {window} (exact up to it)")
        seq = window
    return dict(
        style="llama",
        num_layers=config["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=n,
        num_query_groups=config.get("num_key_value_heads") or n,
        ffn_hidden_size=config["intermediate_size"],
        seq_length=seq,
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
        bias=bias,
        qkv_bias=qkv_bias,
        sliding_window=window,
        init_method_std=config.get("initializer_range", 0.02),
        **_rope_from_hf(config, where),
    )


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


def _split_qkv(w, arch):
    n, g = arch["num_attention_heads"], arch["num_query_groups"]
    d = arch["hidden_size"] // n
    per = n // g
    x = w.reshape(g, per + 2, d, *w.shape[1:])
    q = x[:, :per].reshape(n * d, *w.shape[1:])
    return q, x[:, per].reshape(g * d, *w.shape[1:]), x[:, per + 1].reshape(g * d, *w.shape[1:])


def _merge_qkv(q, k, v, arch):
    import torch

    n, g = arch["num_attention_heads"], arch["num_query_groups"]
    d = arch["hidden_size"] // n
    per = n // g
    rest = q.shape[1:]
    x = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return x.reshape(g * (per + 2) * d, *rest)


def _getter(tensors: Any, what: str) -> Callable[[str], Any]:
    """``name -> tensor`` over a dict or a lazy reader; a missing name is an error naming it."""

    def get(name: str) -> Any:
        if name not in tensors:
            raise ExportError(f"tensor {name} missing from the {what}")
        return tensors[name]

    return get


def layer_to_hf(arch: dict[str, Any], i: int, get: Callable[[str], Any]) -> dict[str, Any]:
    """HF tensors of transformer layer ``i`` (independent contiguous tensors); ``get``: megatron name -> tensor."""
    import torch

    family = hf_family(arch)
    f = arch["ffn_hidden_size"]
    a = f"decoder.layers.{i}."
    out: dict[str, Any] = {}

    def put(name: str, t: Any) -> None:
        out[name] = t.detach().contiguous().clone()

    qkv_bias, bias = arch.get("qkv_bias", arch["bias"]), arch["bias"]
    if family == "gpt2":
        p = f"transformer.h.{i}."
        q, k, v = _split_qkv(get(a + "self_attention.linear_qkv.weight"), arch)
        put(p + "attn.c_attn.weight", torch.cat([q, k, v]).t())
        put(p + "attn.c_proj.weight", get(a + "self_attention.linear_proj.weight").t())
        put(p + "mlp.c_fc.weight", get(a + "mlp.linear_fc1.weight").t())
        put(p + "mlp.c_proj.weight", get(a + "mlp.linear_fc2.weight").t())
        if bias:
            put(p + "attn.c_attn.bias", torch.cat(_split_qkv(get(a + "self_attention.linear_qkv.bias"), arch)))
            put(p + "attn.c_proj.bias", get(a + "self_attention.linear_proj.bias"))
            put(p + "mlp.c_fc.bias", get(a + "mlp.linear_fc1.bias"))
            put(p + "mlp.c_proj.bias", get(a + "mlp.linear_fc2.bias"))
        else:  # GPT2LMHeadModel always has biases: zeros compute the same
            h = arch["hidden_size"]
            z = get(a + "self_attention.linear_proj.weight").new_zeros
            out.update({p + "attn.c_attn.bias": z(3 * h), p + "attn.c_proj.bias": z(h), p + "mlp.c_fc.bias": z(f)})
            out[p + "mlp.c_proj.bias"] = z(h)
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            put(p + theirs + ".weight", get(a + ours + ".weight"))
            put(p + theirs + ".bias", get(a + ours + ".bias"))
        return out
    p = f"model.layers.{i}."
    for name, t in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(get(a + "self_attention.linear_qkv.weight"), arch)):
        put(p + f"self_attn.{name}.weight", t)
    put(p + "self_attn.o_proj.weight", get(a + "self_attention.linear_proj.weight"))
    fc1 = get(a + "mlp.linear_fc1.weight")
    put(p + "mlp.gate_proj.weight", fc1[:f])
    put(p + "mlp.up_proj.weight", fc1[f:])
    put(p + "mlp.down_proj.weight", get(a + "mlp.linear_fc2.weight"))
    if qkv_bias:
        for name, t in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(get(a + "self_attention.linear_qkv.bias"), arch)):
            put(p + f"self_attn.{name}.bias", t)
    if bias:
        put(p + "self_attn.o_proj.bias", get(a + "self_attention.linear_proj.bias"))
        b1 = get(a + "mlp.linear_fc1.bias")
        put(p + "mlp.gate_proj.bias", b1[:f])
        put(p + "mlp.up_proj.bias", b1[f:])
        put(p + "mlp.down_proj.bias", get(a + "mlp.linear_fc2.bias"))
    put(p + "input_layernorm.weight", get(a + "input_layernorm.weight"))
    put(p + "post_attention_layernorm.weight", get(a + "pre_mlp_layernorm.weight"))
    return out


def outer_to_hf(arch: dict[str, Any], get: Callable[[str], Any], vocab_size: int) -> dict[str, Any]:
    """HF tensors outside the layers: embeddings, final norm, an untied output layer (padding rows dropped)."""
    gpt2 = hf_family(arch) == "gpt2"
    out = {
        ("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"): get("embedding.word_embeddings.weight")[
            :vocab_size
        ]
    }
    if gpt2:
        out["transformer.wpe.weight"] = get("embedding.position_embeddings.weight")
        out["transformer.ln_f.weight"] = get("decoder.final_layernorm.weight")
        out["transformer.ln_f.bias"] = get("decoder.final_layernorm.bias")
    else:
        out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    if not arch["tie_embeddings"]:
        out["lm_head.weight"] = get("output_layer.weight")[:vocab_size]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def to_hf(arch: dict[str, Any], m: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """HF state dict (independent contiguous tensors) from megatron tensors."""
    get = _getter(m, "megatron checkpoint")
    out = outer_to_hf(arch, get, vocab_size)
    for i in range(arch["num_layers"]):
        out.update(layer_to_hf(arch, i, get))
    return out


def layer_from_hf(arch: dict[str, Any], i: int, get: Callable[[str], Any]) -> dict[str, Any]:
    """Megatron tensors (local-spec names) of transformer layer ``i``; ``get``: HF name -> tensor."""
    import torch

    a = f"decoder.layers.{i}."
    out: dict[str, Any] = {}
    qkv_bias, bias = arch.get("qkv_bias", arch["bias"]), arch["bias"]
    if hf_family(arch) == "gpt2":
        h = arch["hidden_size"]
        p = f"transformer.h.{i}."
        w = get(p + "attn.c_attn.weight").t()
        out[a + "self_attention.linear_qkv.weight"] = _merge_qkv(w[:h], w[h : 2 * h], w[2 * h :], arch)
        out[a + "self_attention.linear_proj.weight"] = get(p + "attn.c_proj.weight").t()
        out[a + "mlp.linear_fc1.weight"] = get(p + "mlp.c_fc.weight").t()
        out[a + "mlp.linear_fc2.weight"] = get(p + "mlp.c_proj.weight").t()
        if bias:
            b = get(p + "attn.c_attn.bias")
            out[a + "self_attention.linear_qkv.bias"] = _merge_qkv(b[:h], b[h : 2 * h], b[2 * h :], arch)
            out[a + "self_attention.linear_proj.bias"] = get(p + "attn.c_proj.bias")
            out[a + "mlp.linear_fc1.bias"] = get(p + "mlp.c_fc.bias")
            out[a + "mlp.linear_fc2.bias"] = get(p + "mlp.c_proj.bias")
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[a + ours + ".weight"] = get(p + theirs + ".weight")
            out[a + ours + ".bias"] = get(p + theirs + ".bias")
        return out
    p = f"model.layers.{i}."
    qkv = [get(p + f"self_attn.{x}.weight") for x in ("q_proj", "k_proj", "v_proj")]
    out[a + "self_attention.linear_qkv.weight"] = _merge_qkv(qkv[0], qkv[1], qkv[2], arch)
    out[a + "self_attention.linear_proj.weight"] = get(p + "self_attn.o_proj.weight")
    out[a + "mlp.linear_fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    out[a + "mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
    if qkv_bias:
        qkvb = [get(p + f"self_attn.{x}.bias") for x in ("q_proj", "k_proj", "v_proj")]
        out[a + "self_attention.linear_qkv.bias"] = _merge_qkv(qkvb[0], qkvb[1], qkvb[2], arch)
    if bias:
        out[a + "self_attention.linear_proj.bias"] = get(p + "self_attn.o_proj.bias")
        out[a + "mlp.linear_fc1.bias"] = torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
        out[a + "mlp.linear_fc2.bias"] = get(p + "mlp.down_proj.bias")
    out[a + "input_layernorm.weight"] = get(p + "input_layernorm.weight")
    out[a + "pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
    return out


def outer_from_hf(
    arch: dict[str, Any], get: Callable[[str], Any], has: Callable[[str], bool], padded_vocab: int
) -> dict[str, Any]:
    """Megatron tensors outside the layers; the vocabulary zero-padded to ``padded_vocab``."""
    import torch

    def pad(t: Any) -> Any:
        if t.shape[0] > padded_vocab:
            raise ExportError(f"vocabulary {t.shape[0]} is larger than the padded size {padded_vocab}")
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])

    gpt2 = hf_family(arch) == "gpt2"
    emb_name = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    out = {"embedding.word_embeddings.weight": pad(get(emb_name))}
    if gpt2:
        out["embedding.position_embeddings.weight"] = get("transformer.wpe.weight")
        out["decoder.final_layernorm.weight"] = get("transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = get("transformer.ln_f.bias")
    else:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not arch["tie_embeddings"]:
        out["output_layer.weight"] = pad(get("lm_head.weight" if has("lm_head.weight") else emb_name))
    return out


def from_hf(arch: dict[str, Any], hf: dict[str, Any], padded_vocab: int) -> dict[str, Any]:
    """Megatron tensors (local-spec names) from an HF state dict; the vocabulary zero-padded."""
    get = _getter(hf, "Hugging Face checkpoint")
    out = outer_from_hf(arch, get, lambda name: name in hf, padded_vocab)
    for i in range(arch["num_layers"]):
        out.update(layer_from_hf(arch, i, get))
    return out


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
) -> Path:
    """:func:`export_hf` reading the checkpoint one layer at a time (``info``: ``describe_run``'s)."""
    from snakellm.export.stream import read_groups

    groups = read_groups(info["checkpoint_dir"], info["iteration"], info["arch"], info["padded_vocab_size"])
    source = {"source": str(info["checkpoint_dir"]), "iteration": info["iteration"]}
    return write_export(
        info["arch"],
        groups,
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


def main_export(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm export-hf",
        description="Write a Hugging Face model directory (GPT2LMHeadModel or LlamaForCausalLM: config.json, "
        "generation_config.json, model.safetensors (sharded above --max-shard-size), tokenizer files) from a "
        "checkpoint.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    p.add_argument("out", help="output directory (replaced atomically)")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weight dtype (auto: the checkpoint's)",
    )
    p.add_argument(
        "--blend",
        default=None,
        help="blend.json whose tokenizer block names the tokenizer files (default: the checkpoint's run_config)",
    )
    p.add_argument(
        "--tokenizer-base",
        default=None,
        help="directory that relative tokenizer file paths are relative to (default: the working directory)",
    )
    a = p.parse_args(argv)
    from snakellm.models.loading import LoadError, describe_run

    try:
        info = describe_run(a.checkpoint, a.iteration)
        family = hf_family(info["arch"])  # before torch: an unsupported model fails at once
        tok = info["tokenizer"]
        if a.blend:
            tok = tokenizer_from_blend(a.blend)
        if not tok.get("files"):
            raise LoadError(f"{info['checkpoint_dir']}: no tokenizer files recorded; pass --blend")
    except (LoadError, ExportError, KeyError) as e:
        print(f"snakellm export-hf: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    from snakellm.launch.runtime import ensure_single_process

    ensure_single_process("cpu")
    out = export_hf_from_checkpoint(  # one layer in memory at a time
        {**info, "tokenizer": tok},
        a.out,
        max_shard_size=a.max_shard_size,
        dtype=a.dtype,
        tokenizer_base=Path(a.tokenizer_base) if a.tokenizer_base else None,
    )
    log(f"exported {info['checkpoint_dir']} ({family}) to {out} in {time.time() - t0:.1f} s")
    return 0


def main_import(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm import-hf",
        description="Convert a Hugging Face GPT-2 or Llama model directory into a snakellm run directory: "
        "RUN_DIR/checkpoints/iter_0000000/ (megatron-core torch_dist, model only) + run_config.json, and the "
        "tokenizer under RUN_DIR/tokenizer/. Fine-tuning and export start from it like from a pretrained run.",
    )
    p.add_argument("hf_dir", help="a Hugging Face model directory (config.json + safetensors/pytorch_model.bin)")
    p.add_argument("run_dir", help="output run directory")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="embedding padding (Megatron's)")
    a = p.parse_args(argv)
    hf_dir = Path(a.hf_dir)
    try:
        if not (hf_dir / "config.json").is_file():
            raise ExportError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
        arch_from_hf(json.loads((hf_dir / "config.json").read_text()), str(hf_dir / "config.json"))
    except ExportError as e:
        print(f"snakellm import-hf: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    summary = import_hf(hf_dir, a.run_dir, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    write_json(Path(a.run_dir) / "import_summary.json", summary)
    log(f"imported {hf_dir} into {a.run_dir} in {time.time() - t0:.1f} s")
    return 0


main = main_export

if __name__ == "__main__":
    sys.exit(main_export())
