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


def _ddp_moe(bf16: bool = True):
    """tiny-qwen3-moe under megatron-core DDP (fp32 gradient buffers), as the assembly wraps it."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    from snakellm.launch import runtime
    from snakellm.models import resolve
    from snakellm.models.build import build_model

    runtime.ensure_single_process("cpu")
    arch = resolve("tiny-qwen3-moe", {"seq_length": 32})
    model, tcfg = build_model(arch, 256, seed=5, bf16=bf16)
    return DDP(tcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def _train(ddp, opt, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(32)[None].expand(2, -1)
    norms = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        ddp.zero_grad_buffer()
        ddp(ids, pos, None, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        norms.append(opt.step(3e-3).item())
    return norms


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_coalesced_runs_of_ddps_buffer_update_as_one_tensor_a_parameter_does(clip: float) -> None:
    """bf16 weights under megatron-core DDP: the optimizer takes each run of parameters whose ``main_grad``s lie
    back to back in DDP's buffer as one fp32 master and one gradient view (the 2,100 tensors of Qwen3-30B-A3B's
    8 layers become about 100). Against one tensor a parameter: 4 steps give the same masters and bf16 weights
    bit for bit without clipping; with it, one step gives masters within the fp32 rounding of the norm (summed
    over other tensors; later bf16 roundings then part the runs); every master a view of its run's tensor."""
    from snakellm.train.optim import MixedPrecisionAdamW, _Run

    out = {}
    for coalesce in (True, False):
        ddp = _ddp_moe()
        opt = MixedPrecisionAdamW(
            ddp, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=clip, fused=False, coalesce=coalesce
        )
        tensors = sum(len(g["params"]) for g in opt.optimizer.param_groups)
        params = sum(1 for p in ddp.parameters() if p.requires_grad)
        if coalesce:
            assert opt.coalesced and tensors * 3 < params, (tensors, params)
            runs = [e for row in opt.entries for e in row if isinstance(e, _Run)]
            assert runs and all(
                v.untyped_storage().data_ptr() == r.master.untyped_storage().data_ptr() for r in runs for v in r.views
            )
        else:
            assert not opt.coalesced and tensors == params
        norms = _train(ddp, opt, 4 if clip == 0 else 1)
        out[coalesce] = (norms, [m.detach().clone() for g in opt.master_groups for m in g], dict(ddp.state_dict()))
    (na, ma, sa), (nb, mb, sb) = out[True], out[False]
    assert na == pytest.approx(nb, rel=1e-6)
    assert clip == 0 or na[0] > clip  # the clip is active
    for a, b in zip(ma, mb, strict=True):
        if clip == 0:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for k, v in sa.items():
        if torch.is_tensor(v) and v.is_floating_point() and clip == 0:
            assert torch.equal(v, sb[k]), k


def test_coalesced_optimizer_state_is_one_state_a_parameter_in_and_out_of_checkpoints() -> None:
    """What a checkpoint holds of the coalesced optimizer is torch AdamW's state of one tensor a parameter (the
    layout of Megatron's Float16OptimizerWithFloat16Params): equal to the uncoalesced optimizer's after the same
    steps; loaded into a fresh coalesced optimizer it continues that run bit for bit."""
    from snakellm.train.optim import MixedPrecisionAdamW

    def make(coalesce: bool):
        ddp = _ddp_moe()
        kw = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0, fused=False)
        return ddp, MixedPrecisionAdamW(ddp, coalesce=coalesce, **kw)

    (da, oa), (db, ob) = make(True), make(False)
    _train(da, oa, 3)
    _train(db, ob, 3)
    mine, theirs = oa._per_param_state(), ob.optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        assert st.keys() == mine["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(mine["state"][i][k], v), (i, k)
    # the uncoalesced run's checkpoint (its optimizer state and masters) into a fresh coalesced optimizer
    dc, oc = make(True)
    saved = {
        "optimizer": ob.optimizer.state_dict(),
        "fp32_from_fp16_params": [[m.clone() for m in g] for g in ob.master_groups],
    }
    oc.load_state_dict(saved)
    for a, b in zip(dc.parameters(), db.parameters(), strict=True):
        assert torch.equal(a, b)
    _train(dc, oc, 2, seed=1)
    _train(db, ob, 2, seed=1)
    for a, b in zip([m for g in oc.master_groups for m in g], [m for g in ob.master_groups for m in g], strict=True):
        assert torch.equal(a, b)
