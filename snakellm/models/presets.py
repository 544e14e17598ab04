"""Named model shapes: each preset names every architectural key it fixes.

Config and CLI overrides replace single keys on top of a preset (see
:func:`snakellm.models.architecture.resolve`). Plain data, no imports: the
schema's preset list and ``snakellm train --preset`` choices are derived from
this dict.
"""

from __future__ import annotations

from typing import Any

# Each preset names every architectural key; config overrides replace single keys.
PRESETS: dict[str, dict[str, Any]] = {
    # the CPU default: trains in minutes on 2 cores
    "tiny": dict(
        style="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128
    ),
    "tiny-llama": dict(
        style="llama",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=176,
        seq_length=128,
    ),
    "gpt2-124m": dict(
        style="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=1024
    ),
    "gpt2-350m": dict(
        style="gpt2", num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=1024
    ),
    "gpt2-774m": dict(
        style="gpt2", num_layers=36, hidden_size=1280, num_attention_heads=20, ffn_hidden_size=5120, seq_length=1024
    ),
    # TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads in 4 KV groups, SwiGLU 5632
    "llama-1b": dict(
        style="llama",
        num_layers=22,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        ffn_hidden_size=5632,
        seq_length=2048,
    ),
    # Llama 3.2 1B's shape: 16 layers, d=2048, 32 heads in 8 KV groups, SwiGLU 8192, tied embeddings, RoPE base
    # 500000 with its Llama 3.x scaling (factor 32, low/high 1/4, original 8192); trains at 2048 tokens
    "llama3-1b": dict(
        style="llama",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        seq_length=2048,
        tie_embeddings=True,
        rotary_base=500000,
        rope_scaling_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_positions=8192,
    ),
    # Qwen2.5 0.5B's shape: 24 layers, d=896, 14 heads in 2 KV groups, SwiGLU 4864, q/k/v-only biases, tied
    # embeddings, RoPE base 1e6, RMSNorm eps 1e-6; trains at 2048 tokens
    "qwen2.5-0.5b": dict(
        style="llama",
        num_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_query_groups=2,
        ffn_hidden_size=4864,
        seq_length=2048,
        tie_embeddings=True,
        qkv_bias=True,
        rotary_base=1000000,
        layernorm_epsilon=1e-6,
    ),
}
