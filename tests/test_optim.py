"""snakellm.train.optim: the fused AdamW's clip (on the GPU path) against the foreach one (the CPU path)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_the_fused_adamw_clips_through_its_grad_scale_as_the_foreach_one_does(clip: float) -> None:
    """Where torch's fused AdamW runs (CUDA), the clip coefficient reaches it as ``grad_scale`` (the gradient
    divided by it as it is read: no pass of its own); torch's fused AdamW on the CPU runs the same algorithm,
    so the two paths are compared here over 5 steps of bf16 weights with fp32 masters, with the clip active
    (0.05) and not (100): the same gradient norms, masters within fp32 rounding, the scale cleared after."""
    from snakellm.launch import runtime
    from snakellm.train.optim import MixedPrecisionAdamW

    runtime.ensure_single_process("cpu")
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).bfloat16()
        opt = MixedPrecisionAdamW(
            model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=clip, fused=fused
        )
        assert bool(opt.optimizer.defaults.get("fused")) is fused
        gen = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(5):
            for p in model.parameters():  # what megatron-core DDP hands the optimizer: fp32 main gradients
                p.main_grad = torch.randn(p.shape, generator=gen)
            norms.append(opt.step(1e-2).item())
            assert getattr(opt.optimizer, "grad_scale", None) is None
        runs.append((norms, [m.detach().clone() for g in opt.master_groups for m in g]))
    (nf, mf), (nu, mu) = runs
    assert nf == pytest.approx(nu, rel=1e-6)
    assert (min(nf) > clip) == (clip < 1)  # the clip is active in one case, never in the other
    for a, b in zip(mf, mu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
