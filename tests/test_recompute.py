"""Activation recomputation is megatron-core's own, it really recomputes, and it changes no number.

One process (gloo): the same GPT (its weights drawn by snakellm.models.build.init_weights, so every build
is the same model) run forward and backward without recomputation, with selective recomputation (core
attention) and with full recomputation (uniform and block). The core attention's forward runs again in
the backward pass exactly where the setting says, and the loss and every gradient are bit-identical.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")


@functools.cache
def _run(recompute: str, method: str = "uniform", num_layers: int = 1):
    from snakellm import models
    from snakellm.launch.runtime import ensure_single_process
    from snakellm.models.build import build_model

    ensure_single_process("cpu")
    cfg = models.resolve("tiny-llama", {"num_layers": 4, "seq_length": 32})
    model, tcfg = build_model(
        cfg,
        128,
        fused_loss="eager",
        recompute=recompute,
        recompute_method=method,
        recompute_num_layers=num_layers,
        seed=7,
    )
    model.train()
    calls = [0] * cfg["num_layers"]
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.core_attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    pos = torch.arange(32).expand(2, 32)
    loss = model(tokens, pos, None, labels=torch.roll(tokens, -1, 1)).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return tcfg, loss.detach(), grads, calls


@pytest.mark.parametrize(
    "setting, expected_calls",
    [
        (("selective",), [2, 2, 2, 2]),
        (("full", "uniform", 2), [2, 2, 2, 2]),
        (("full", "block", 1), [2, 1, 1, 1]),
    ],
)
def test_recomputation_reruns_where_asked_and_changes_no_number(setting, expected_calls):
    _, loss0, grads0, calls0 = _run("none")
    assert calls0 == [1, 1, 1, 1]
    tcfg, loss, grads, calls = _run(*setting)
    assert tcfg.recompute_granularity == setting[0]
    assert calls == expected_calls
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    for name in grads:
        assert torch.equal(grads[name], grads0[name]), name
