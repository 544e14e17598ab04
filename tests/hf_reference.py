"""A megatron-core GPTModel's weights in a Hugging Face model, for comparing logits in tests.

The test-side stand-in for the Hugging Face export (GPT-2 style -> GPT2LMHeadModel,
Llama style -> LlamaForCausalLM), written from the two libraries' layouts:
megatron-core's fused qkv rows are interleaved per query group ``[q_g..., k_g, v_g]``,
its SwiGLU ``linear_fc1`` is ``[gate; up]``, GPT-2's ``Conv1D`` weights are transposed.
"""

from __future__ import annotations

import torch


def _qkv_split(w: torch.Tensor, arch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nh, ng, h = arch["num_attention_heads"], arch["num_query_groups"], arch["hidden_size"]
    d = h // nh
    per = nh // ng
    w = w.reshape(ng, (per + 2) * d, *w.shape[1:])
    q = w[:, : per * d].reshape(nh * d, *w.shape[2:])
    k = w[:, per * d : (per + 1) * d].reshape(ng * d, *w.shape[2:])
    v = w[:, (per + 1) * d :].reshape(ng * d, *w.shape[2:])
    return q, k, v


def to_hf(gpt, arch: dict, vocab: int):
    sd = {k: v.detach().float().clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    L = arch["num_layers"]
    if arch["style"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=vocab,
            n_positions=arch["seq_length"],
            n_embd=arch["hidden_size"],
            n_layer=L,
            n_head=arch["num_attention_heads"],
            n_inner=arch["ffn_hidden_size"],
            activation_function="gelu",
            layer_norm_epsilon=arch["layernorm_epsilon"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        )
        m = GPT2LMHeadModel(cfg)
        out = {
            "transformer.wte.weight": sd["embedding.word_embeddings.weight"],
            "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
            "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
            "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"],
            "lm_head.weight": sd["embedding.word_embeddings.weight"],
        }
        for i in range(L):
            p, q = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out[q + "ln_1.weight"] = (
                sd[p + "self_attention.linear_qkv.layer_norm_weight"]
                if p + "self_attention.linear_qkv.layer_norm_weight" in sd
                else sd[p + "input_layernorm.weight"]
            )
            out[q + "ln_1.bias"] = sd.get(p + "input_layernorm.bias")
            qw, kw, vw = _qkv_split(sd[p + "self_attention.linear_qkv.weight"], arch)
            qb, kb, vb = _qkv_split(sd[p + "self_attention.linear_qkv.bias"], arch)
            out[q + "attn.c_attn.weight"] = torch.cat([qw, kw, vw]).t()
            out[q + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            out[q + "attn.c_proj.weight"] = sd[p + "self_attention.linear_proj.weight"].t()
            out[q + "attn.c_proj.bias"] = sd[p + "self_attention.linear_proj.bias"]
            out[q + "ln_2.weight"] = sd[p + "pre_mlp_layernorm.weight"]
            out[q + "ln_2.bias"] = sd[p + "pre_mlp_layernorm.bias"]
            out[q + "mlp.c_fc.weight"] = sd[p + "mlp.linear_fc1.weight"].t()
            out[q + "mlp.c_fc.bias"] = sd[p + "mlp.linear_fc1.bias"]
            out[q + "mlp.c_proj.weight"] = sd[p + "mlp.linear_fc2.weight"].t()
            out[q + "mlp.c_proj.bias"] = sd[p + "mlp.linear_fc2.bias"]
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=arch["hidden_size"],
            intermediate_size=arch["ffn_hidden_size"],
            num_hidden_layers=L,
            num_attention_heads=arch["num_attention_heads"],
            num_key_value_heads=arch["num_query_groups"],
            max_position_embeddings=arch["seq_length"],
            rms_norm_eps=arch["layernorm_epsilon"],
            rope_theta=float(arch["rotary_base"]),
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
        m = LlamaForCausalLM(cfg)
        out = {
            "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
            "model.norm.weight": sd["decoder.final_layernorm.weight"],
            "lm_head.weight": sd["output_layer.weight"],
        }
        for i in range(L):
            p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
            out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            qw, kw, vw = _qkv_split(sd[p + "self_attention.linear_qkv.weight"], arch)
            (
                out[q + "self_attn.q_proj.weight"],
                out[q + "self_attn.k_proj.weight"],
                out[q + "self_attn.v_proj.weight"],
            ) = qw, kw, vw
            out[q + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"]
            out[q + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
            gate, up = sd[p + "mlp.linear_fc1.weight"].chunk(2)
            out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
            out[q + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"]
    out = {k: v for k, v in out.items() if v is not None}
    missing, unexpected = m.load_state_dict(out, strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq"))]
    assert not missing and not unexpected, (missing, unexpected)
    return m.eval()
