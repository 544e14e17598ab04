"""snakellm.models.memory against hand calculations: Korthikanti et al.'s activation formulas, Megatron's
bytes-per-parameter table, and the 8B example's numbers worked out term by term."""

from __future__ import annotations

import pytest

from snakellm import models as A
from snakellm.models import memory as M

# a GPT layer as in the paper: MHA, 4h MLP, GeLU, dropout everywhere, unfused attention
GPT = A.resolve(
    None,
    dict(
        style="gpt2",
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=2048,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
)
s, b, h, a = 2048, 2, 1024, 16


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activations_per_layer_are_korthikanti_et_al_eq_1_to_4(t):
    def layer(**kw):
        return M.layer_activation_bytes(GPT, b, tp=t, flash_attention=False, **kw)

    sbh = s * b * h
    # eq. 1 (t = 1) and eq. 2: tensor parallel, no sequence parallelism
    assert layer() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    # eq. 3: tensor + sequence parallel
    assert layer(sequence_parallel=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    # eq. 4: selective recomputation of the attention core, with sequence parallelism
    assert layer(sequence_parallel=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    # full recomputation keeps the layer input only: 2 s b h (/ t with sequence parallelism)
    assert layer(recompute="full") == 2 * sbh
    assert layer(sequence_parallel=True, recompute="full") == pytest.approx(2 * sbh / t)


def test_fused_attention_and_no_dropout_drop_the_score_and_mask_terms():
    no_dropout = dict(GPT, hidden_dropout=0.0, attention_dropout=0.0)
    sbh = s * b * h
    # no masks: 10 -> 8 outside the TP regions; flash keeps a float32 log-sum-exp per query and head instead of s x s
    assert M.layer_activation_bytes(no_dropout, b, flash_attention=True) == sbh * (8 + 24) + 4 * a * s * b


def test_swiglu_and_grouped_query_attention_count_their_own_widths():
    llama = A.resolve("llama-1b")  # h 2048, 32 heads in 4 groups (kv width 256), SwiGLU f 5632, no dropout
    s_, b_, h_, kv, f = 2048, 1, 2048, 256, 5632
    by_hand = (
        4 * 2 * s_ * b_ * h_  # norm inputs and outputs
        + 2 * s_ * b_ * (h_ + kv)
        + 2 * s_ * b_ * kv  # Q, K; V
        + 2 * s_ * b_ * h_  # attention output
        + 2 * s_ * b_ * 2 * f
        + 2 * s_ * b_ * f  # up projection (gate + up), down projection input
        + 4 * 32 * s_ * b_
    )  # flash log-sum-exp
    # a GPU's fused SwiGLU keeps only its input; the CPU's unfused one keeps SiLU(gate) for the product's backward
    assert M.layer_activation_bytes(llama, 1) == by_hand
    assert M.layer_activation_bytes(llama, 1, fused_swiglu=False) == by_hand + 2 * s_ * b_ * f


@pytest.mark.parametrize("preset,vocab", [("gpt2-124m", 50257), ("llama-1b", 32000), ("tiny", 2000)])
def test_parameters_on_one_gpu_are_the_model_and_18_bytes_each(preset, vocab):
    arch = A.resolve(preset)
    v = A.padded_vocab_size(vocab, arch)
    e = M.estimate(arch, v)
    assert e.params == A.param_count(arch, v)
    # Megatron's table: bf16 weights 2 + fp32 grads 4 + fp32 master, m, v 12 = 18 bytes a parameter
    assert (e.weights, e.grads, e.optimizer) == (2 * e.params, 4 * e.params, 12 * e.params)
    # the distributed optimizer: 6 + 12 / dp
    d = M.estimate(arch, v, dp=8, distributed_optimizer=True)
    assert d.model_states == pytest.approx(e.params * (6 + 12 / 8))
    # fp32 training: 4 + 4 + 8 (no master copy)
    f = M.estimate(arch, v, bf16=False)
    assert f.model_states == 16 * e.params


def test_the_8b_example_per_gpu_by_hand():
    """NeMo's gpt3/7b_improved on TP 4 x DP 16, micro batch 1: the terms written out."""
    import yaml
    from conftest import REPO

    run = yaml.safe_load((REPO / "config" / "examples" / "slimpajama-gpt-8b.yaml").read_text())["runs"]["gpt-8b"]
    arch = A.resolve(None, run["model"])
    v = A.padded_vocab_size(50257, arch, 4)
    assert v == 50688  # a multiple of 128 x 4
    h, f, L, t, seq = 4096, 10880, 32, 4, 2048
    layer = (h * 3 * h + h * h + h * 2 * f + f * h) / t + 2 * 2 * h  # QKV, out, gate+up, down over 4; 2 LayerNorms
    params = L * layer + v * h / t + (2 * h + v * h / t)  # + embedding shard, final norm + output layer shard
    e = M.estimate(arch, v, tp=4, dp=16, micro_batch_size=1, num_micro_batches=32, sequence_parallel=False)
    assert e.params == round(params) == 1_710_759_936
    assert e.weights == 2 * params and e.grads == 4 * params and e.optimizer == 12 * params
    sbh = seq * h
    per_layer = (
        4 * 2 * sbh + (2 * seq * 2 * h + 2 * seq * h + 2 * sbh + 2 * seq * 2 * f + 2 * seq * f + 4 * 32 * seq) / t
    )
    acts = L * per_layer + 2 * sbh + 2 * sbh + 6 * seq * v / t  # + embedding output, final norm input, logits
    assert e.activations == pytest.approx(acts)
    assert e.total / M.GiB == pytest.approx(32.35, abs=0.01)
    assert "fits in 80 GiB" in "\n".join(e.lines(80)) and "does NOT fit in 24 GiB" in "\n".join(e.lines(24))
    # with megatron-core's sequence parallelism and distributed optimizer
    d = M.estimate(arch, v, tp=4, dp=16, micro_batch_size=1, sequence_parallel=True, distributed_optimizer=True)
    assert d.optimizer == pytest.approx(12 * params / 16)
    # the parts outside the tensor-parallel regions (norms, embedding output, final norm input) are split too
    assert d.activations == pytest.approx(acts - (L * 4 * 2 * sbh + 2 * sbh + 2 * sbh) * (1 - 1 / t))


def test_pipeline_first_stage_holds_p_micro_batches_of_its_layers():
    arch = A.resolve("gpt2-124m")
    one = M.layer_activation_bytes(arch, 4)
    emb = 2 * 1024 * 4 * 768  # the embedding output, per micro-batch in flight
    # a small vocabulary, so that the first stage is the fullest
    e = M.estimate(arch, 128, pp=4, micro_batch_size=4, num_micro_batches=16)
    assert e.activations == 4 * (3 * one + emb)  # L/p = 3 layers x p = 4 micro-batches: L layers' worth
    e2 = M.estimate(arch, 128, pp=4, micro_batch_size=4, num_micro_batches=2)
    assert e2.activations == 2 * (3 * one + emb)  # only 2 micro-batches ever in flight
    # GPT-2's 50k vocabulary: the last stage, with the output layer and its logits, is the fullest
    last = M.estimate(arch, 50304, pp=4, micro_batch_size=4, num_micro_batches=16)
    assert last.activations == 3 * one + 2 * 1024 * 4 * 768 + 6 * 1024 * 4 * 50304
    with pytest.raises(ValueError, match="not divisible by pipeline"):
        M.estimate(arch, 50304, pp=5)


def test_full_recomputation_keeps_inputs_by_its_method_and_interleaving_adds_in_flight_micro_batches():
    """uniform: each group of n layers keeps its input, plus one group's activations while it recomputes; block:
    the first n layers keep their input, the rest everything; interleaving keeps (1 + (p-1)/(p v)) x 1F1B's."""
    arch = A.resolve("gpt2-124m")  # 12 layers, sequence 1024
    whole = M.layer_activation_bytes(arch, 1)
    inp = M.layer_activation_bytes(arch, 1, recompute="full")
    assert inp == 2 * 1024 * 768
    base = M.estimate(arch, 50304).activations - 12 * whole  # embedding and head, the same in every case
    assert M.estimate(arch, 50304, recompute="full").activations == pytest.approx(base + 12 * inp + whole)
    uni4 = M.estimate(arch, 50304, recompute="full", recompute_num_layers=4).activations
    assert uni4 == pytest.approx(base + 3 * inp + 4 * whole)
    block = M.estimate(arch, 50304, recompute="full", recompute_method="block", recompute_num_layers=4).activations
    assert block == pytest.approx(base + 4 * inp + 8 * whole + whole)
    # a small vocabulary, so that the first stage is the fullest in both
    f1b = M.estimate(arch, 128, pp=4, micro_batch_size=4, num_micro_batches=16).activations
    inter = M.estimate(arch, 128, pp=4, virtual_pp=3, micro_batch_size=4, num_micro_batches=16).activations
    assert inter == pytest.approx(f1b * (1 + 3 / 12))
    with pytest.raises(ValueError, match="virtual pipeline size 2"):
        M.estimate(arch, 50304, pp=4, virtual_pp=2)  # 12 layers in 8 chunks
