"""The vocabulary-parallel fused cross-entropy (snakellm.models.loss) at TP 2 against one process, on gloo.

Each of 2 ranks holds half of the vocabulary's logits; the loss and the
gradient of the logits must be those of torch's cross-entropy over the whole
vocabulary (fp32), with targets on either rank.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from snakellm.models.loss import cross_entropy, vocab_parallel_cross_entropy

S, B, V = 12, 3, 40


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, V, generator=g, dtype=torch.float64).float() * 3
    labels = torch.randint(0, V, (B, S), generator=g)
    return logits, labels


def _rank(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, labels = _data()
        vp = V // world
        part = logits[..., rank * vp : (rank + 1) * vp].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(part, labels, compiled=False, group=dist.group.WORLD)
        (loss * torch.arange(1, S + 1).float()).sum().backward()  # a non-uniform upstream gradient
        q.put((rank, loss.detach().numpy(), part.grad.numpy()))  # numpy: no shared-memory handles
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two spawned processes importing torch: ~10 s, too much for the fast tier
@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_loss_equals_the_whole_vocabulary_loss(world):
    logits, labels = _data()
    ref_in = logits.clone().requires_grad_(True)
    ref = cross_entropy(ref_in, labels)  # [b, s]
    (ref * torch.arange(1, S + 1).float()).sum().backward()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(
        (r, (torch.from_numpy(loss), torch.from_numpy(grad))) for r, loss, grad in (q.get(timeout=120) for _ in procs)
    )
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    vp = V // world
    for r in range(world):
        loss, grad = got[r]
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_in.grad[..., r * vp : (r + 1) * vp], rtol=1e-6, atol=1e-6)
    # the targets fall on both ranks' slices
    assert (labels < V // 2).any() and (labels >= V // 2).any()


@pytest.fixture(scope="module")
def tp2_eager(tmp_path_factory):
    """TP 2 + sequence parallelism on 2 gloo ranks, the eager loss and layers: (root, its flags)."""
    from test_parallel_cpu import train
    from test_train import make_blend

    root = tmp_path_factory.mktemp("tp2-loss")
    make_blend(root)
    flags = ["--preset", "tiny-llama", "--steps", "6", "--eval-iters", "0", "--no-checkpoints", "--tp", "2"]
    flags += ["--sequence-parallel"]
    train(root, "eager", 2, *flags, "--loss", "eager")
    return root, flags


@pytest.mark.slow
def test_compiled_layers_and_loss_under_tp2_and_sequence_parallelism(tp2_eager):
    """`--compile --loss compiled` at TP 2 + sequence parallelism gives the uncompiled run's losses and gradient
    norms: the one check that torch.compile runs megatron-core's tensor-parallel layers and our loss (most of its
    minute is inductor compiling them for the CPU)."""
    from test_parallel_cpu import assert_close, records, train

    root, flags = tp2_eager
    train(root, "compiled", 2, *flags, "--loss", "compiled", "--compile")
    assert_close(records(root, "compiled"), records(root, "eager"), loss_rtol=1e-5, norm_rtol=1e-4)


# the eager kernels give the gradient the same stride as inductor's here: the fast tier holds the fix at no
# compile's cost; the compiled loss (what GPUs run) takes ~4-9 s of inductor on the CPU: the slow tier
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_compiled_gradient_reaches_the_output_layer_as_one_matrix_product(compiled):
    """Micro batch 1 (logits [s, 1, V]): megatron-core's frozen output layer gets the loss's gradient (compiled
    or eager) with row-major strides, so its backward (``grad_output.matmul(weight)``) is one matrix product,
    not a batched one per token (the kernels give the size-1 dimension the stride s * V; at 8B, tensor
    parallel, LoRA, that was 152 ms a micro-batch, 40% of the step)."""
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight

    s, v, h = 64, 48, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, 1, h, generator=g).requires_grad_(True)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (1, s), generator=g)
    own = not dist.is_initialized()  # another test in this process may have started one (world size 1)
    if own:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    assert dist.get_world_size() == 1
    try:
        logits = linear_with_frozen_weight(x, weight, None, False, False, False, tp_group=dist.group.WORLD)
        loss = vocab_parallel_cross_entropy(logits, labels, compiled=compiled, group=dist.group.WORLD)
        mask = (torch.arange(s) % 5 != 0).float()[None]  # a loss mask [1, s], as fine-tuning's answer-only loss
        with torch.profiler.profile() as prof:
            (loss * mask).sum().backward()
    finally:
        if own:
            dist.destroy_process_group()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::mm" in ops and "aten::bmm" not in ops, sorted(o for o in ops if "mm" in o)
    ref = x.detach().clone().requires_grad_(True)
    (cross_entropy(ref @ weight.t(), labels) * mask).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)
