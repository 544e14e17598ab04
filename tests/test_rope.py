"""Llama 3.x RoPE scaling: our inverse frequencies are transformers' own, bit for bit, in training and decoding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (head_dim via hidden/heads, theta, factor, low, high, original max positions)
CASES = [
    (64, 4, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1's values, head_dim 16
    (2048, 32, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B's
    (64, 2, 10000.0, 4.0, 2.0, 3.0, 16),  # every branch (low, medium, high) on a short context
]


def _arch(h, n, theta, factor, low, high, orig):
    from snakellm.models.architecture import resolve

    return resolve(
        None,
        dict(
            style="llama3",
            num_layers=2,
            ffn_hidden_size=128,
            hidden_size=h,
            num_attention_heads=n,
            num_query_groups=n,
            rotary_base=int(theta),
            rope_scaling_factor=factor,
            rope_low_freq_factor=low,
            rope_high_freq_factor=high,
            rope_original_max_positions=orig,
            seq_length=64,
        ),
    )


@pytest.mark.parametrize("case", CASES)
def test_llama3_inv_freq_equals_transformers(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from snakellm.models.families.llama3 import inv_freq

    h, n, theta, factor, low, high, orig = case
    cfg = LlamaConfig(
        hidden_size=h,
        num_attention_heads=n,
        max_position_embeddings=max(orig * 2, 64),
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=theta,
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=orig,
        ),
    )
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_freq(_arch(*case), h // n)
    assert scale == 1.0
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)
    from snakellm.models.families.base import default_rope_inv_freq

    assert not torch.equal(default_rope_inv_freq(_arch(*case), h // n), ours)  # the scaling changes something


def test_megatron_model_and_decoder_use_the_scaled_frequencies():
    from snakellm.export.hf import build_for_import
    from snakellm.models.families.llama3 import inv_freq

    arch = _arch(*CASES[2])
    model = build_for_import(arch, 128)
    assert torch.equal(model.rotary_pos_emb.inv_freq, inv_freq(arch, 32))
    from snakellm.serve.generate import Decoder

    assert torch.equal(Decoder(model, arch, 100).inv_freq, inv_freq(arch, 32))


@pytest.mark.parametrize(
    "style, over, match",
    [
        ("llama3", dict(rope_low_freq_factor=4.0, rope_high_freq_factor=4.0), "must exceed rope_low_freq_factor"),
        ("llama", dict(rope_scaling_factor=8.0), "unknown model key"),
        ("qwen2", dict(bias=True, qkv_bias=True), "Qwen2ForCausalLM has no o_proj"),
        ("mistral", dict(sliding_window=64, seq_length=128), "sliding_window 64 < seq_length 128"),
    ],
)
def test_what_we_cannot_compute_is_refused(style, over, match):
    """Refused when built (training, generation) or exported, with the key and value."""
    from snakellm.export.hf import ExportError, hf_config
    from snakellm.models.architecture import ModelConfigError, resolve
    from snakellm.models.families import FamilyError
    from snakellm.models.families.base import Family

    with pytest.raises((ModelConfigError, FamilyError, ExportError), match=match):
        arch = resolve("tiny-llama", {"style": style, **over})
        fam: Family = __import__("snakellm.models.families", fromlist=["get"]).get(style)
        fam.megatron_config(arch)
        hf_config(arch, 100, {}, "float32")
