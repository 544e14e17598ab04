"""``method: dpo`` under SFT's activation recomputation and FP8 (issue 46: "recomputation and FP8 as in SFT").

One process on the CPU: the recipe's own DPO loss (snakellm.finetune.dpo.DPORecipe.loss: the policy's summed
completion log-probabilities of a micro-batch of pairs, the reference's from the batch, TRL's sigmoid loss)
over a tiny megatron-core Llama built as fine-tuning builds it. Full recomputation changes no number (fp32:
the loss and every gradient equal, for a full and a LoRA policy); FP8 (tests/test_fp8.py's CPU emulation of
the same torchao path, ``SNAKELLM_FP8_ANY_DEVICE=1``) runs the step with a loss close to bf16's and not equal
to it (float8 really used).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

VOCAB = 256


@pytest.fixture(scope="module")
def parallel():
    from snakellm.launch.runtime import ensure_single_process, shutdown

    ensure_single_process("cpu")
    yield
    shutdown()


def _pairs_batch() -> dict:
    """Four pairs (chosen rows, then rejected rows) of a shared prompt and two completions each."""
    from snakellm.finetune import preference as pref

    g = torch.Generator().manual_seed(0)
    pairs = []
    for i in range(4):
        prompt = torch.randint(1, VOCAB, (6 + i,), generator=g).tolist()
        c = torch.randint(1, VOCAB, (5 + i % 2,), generator=g).tolist()
        r = torch.randint(1, VOCAB, (4 + i % 3,), generator=g).tolist()
        pairs.append(pref.Pair(i, pref.Side(prompt + c, len(prompt)), pref.Side(prompt + r, len(prompt))))
    b = pref.collate(pairs, 0)
    b["pair_weight"] = torch.ones(4)
    b["ref_chosen"] = torch.tensor([-30.0, -28.0, -35.0, -31.0])  # a frozen reference's (any fixed numbers)
    b["ref_rejected"] = torch.tensor([-27.0, -33.0, -29.0, -30.5])
    return b


def _recipe():
    """The DPO recipe's loss alone (its settings; no data or model of its own)."""
    from snakellm.finetune.dpo import DPORecipe

    r = DPORecipe.__new__(DPORecipe)
    r.dpo = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "reference": "base"}
    r.ref_free = r.inline_ref = False
    return r


def _step(policy: str, recompute: str = "none", fp8: str | None = None, bf16: bool = False):
    """(loss, gradients of what trains) of one DPO step of the tiny model."""
    from megatron.core import tensor_parallel

    from snakellm.finetune.lora import LoRAConfig
    from snakellm.finetune.recipe import attach
    from snakellm.models import architecture as models
    from snakellm.models.build import build_model

    arch = models.resolve("tiny-llama", {"seq_length": 32, "num_layers": 2})
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(3)
    gpt, _ = build_model(arch, VOCAB, fused_loss="eager", use_te=False, recompute=recompute, bf16=bf16, fp8=fp8, seed=7)
    mcfg = LoRAConfig(rank=4, targets=("linear_qkv", "linear_fc1"), row_init="normal") if policy == "lora" else None
    ft, extra = attach(torch, gpt.train(), policy, mcfg, arch, recompute)
    loss, stats = _recipe().loss(ft, _pairs_batch())
    loss.backward()
    trained = extra.parameters() if extra is not None else gpt.parameters()
    return loss.detach().float(), stats, [p.grad.float().clone() for p in trained if p.requires_grad]


@pytest.mark.parametrize("policy", ["full", "lora"])
def test_a_dpo_step_under_full_recomputation_has_the_same_loss_and_gradients(parallel, policy):
    loss0, stats0, grads0 = _step(policy)
    loss, stats, grads = _step(policy, "full")
    assert abs(loss.item() - loss0.item()) < 1e-6 and loss0.item() > 0
    assert stats.keys() == stats0.keys()
    for k in stats:
        assert abs(float(stats[k]) - float(stats0[k])) < 1e-5, k
    assert len(grads) == len(grads0) > 0
    assert all(g.abs().sum() > 0 for g in grads)
    for a, b in zip(grads0, grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # torchao's float8 path on the CPU: its import and two bf16 builds (~10 s)
@pytest.mark.parametrize("policy", ["full", "lora"])
def test_a_dpo_step_in_fp8_is_close_to_bf16(parallel, monkeypatch, policy):
    from snakellm.models import fp8

    monkeypatch.setenv(fp8.ANY_DEVICE_ENV, "1")
    loss_bf16, stats_bf16, grads_bf16 = _step(policy, bf16=True)
    loss_fp8, stats_fp8, grads_fp8 = _step(policy, fp8="tensorwise", bf16=True)
    assert loss_fp8.item() != loss_bf16.item()  # float8 is really used
    assert abs(loss_fp8.item() / loss_bf16.item() - 1) < 0.05, (loss_fp8, loss_bf16)
    assert abs(float(stats_fp8["logps/chosen"]) / float(stats_bf16["logps/chosen"]) - 1) < 0.05
    assert len(grads_fp8) == len(grads_bf16) > 0 and all(torch.isfinite(g).all() for g in grads_fp8)
