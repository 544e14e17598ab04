"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local spec computes attention unfused (a [b, h, s, s] score
tensor); without Transformer Engine this is the fast path on a GPU (flash /
cuDNN kernels) and a memory-lean one on the CPU.
"""

from __future__ import annotations

from typing import Any

ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def sdpa_attention_class(backend: str = "auto") -> Any:
    import contextlib

    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }.get(backend)

    def kernel() -> contextlib.AbstractContextManager[Any]:
        """torch's own kernel choice ("auto"), or the one backend asked for."""
        return contextlib.nullcontext() if chosen is None else sdpa_kernel([chosen])

    class SDPAttention(DotProductAttention):
        """megatron-core's core attention, computed by ``scaled_dot_product_attention``.

        Takes and returns megatron's layouts: q/k/v ``[s, b, heads, d]`` in,
        context ``[s, b, heads * d]`` out. Causal masking is implicit (GPT
        pretraining never passes another mask); grouped-query attention uses
        SDPA's ``enable_gqa`` instead of materialising repeated keys/values.
        """

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            assert packed_seq_params is None and attention_bias is None, (
                "SDPAttention: packed sequences/bias unsupported"
            )
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            p = self.attention_dropout.p if self.training else 0.0
            if p > 0 and not self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            else:
                rng = contextlib.nullcontext()
            # a mask comes only with packed fine-tuning sequences (megatron's convention: True = masked
            # out; causal and block-diagonal per example); pretraining passes None
            mask = None if attention_mask is None else ~attention_mask
            with rng, kernel():
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=p,
                    is_causal=mask is None,
                    scale=self.softmax_scale,
                    enable_gqa=groups > 1,
                )
            s, b = out.size(2), out.size(0)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SDPAttention
