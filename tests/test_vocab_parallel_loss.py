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


@pytest.mark.slow
def test_compiled_layers_and_loss_under_tp2_and_sequence_parallelism(tmp_path):
    """`--compile --loss compiled` at TP 2 + sequence parallelism (2 gloo ranks) gives the uncompiled run's losses
    and gradient norms. About 90 s on 2 cores, most of it inductor compiling the layers and the loss kernels for
    the CPU: the one check that torch.compile runs megatron-core's tensor-parallel layers and our loss."""
    from test_parallel_cpu import assert_close, records, train
    from test_train import make_blend

    make_blend(tmp_path)
    steps = ["--preset", "tiny-llama", "--steps", "6", "--eval-iters", "0", "--no-checkpoints", "--tp", "2"]
    steps += ["--sequence-parallel"]
    train(tmp_path, "eager", 2, *steps, "--loss", "eager")
    train(tmp_path, "compiled", 2, *steps, "--loss", "compiled", "--compile")
    assert_close(records(tmp_path, "compiled"), records(tmp_path, "eager"), loss_rtol=1e-5, norm_rtol=1e-4)
