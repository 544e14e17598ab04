"""Sequence packing for fine-tuning: a packed row computes, token for token, what each example computes alone.

Several SFT examples share a row with positions restarting per example and a block-diagonal causal mask
(snakellm.finetune.dataset.pack / collate_packed / packed_attention_mask); through megatron-core's model
(our SDPA core attention), every answer token's loss must equal the unpacked example's (CPU, random tiny models).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from snakellm.finetune import dataset as ds  # noqa: E402
from snakellm.finetune import runtime  # noqa: E402
from snakellm.models import architecture as models  # noqa: E402

VOCAB = 256
WIDTH = 48


@pytest.fixture(scope="module")
def rt():
    r = runtime.start("cpu", 1, threads=1, seed=3)
    yield r
    runtime.stop()


def _examples(n: int, seed: int) -> list[ds.Example]:
    rng = random.Random(seed)
    return [
        ds.Example(
            [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 20))],
            [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))],
        )
        for _ in range(n)
    ]


def _model(preset: str):
    """A seeded random megatron-core model of ``preset`` at WIDTH positions, in eval mode."""
    from megatron.core import tensor_parallel

    from snakellm.models.build import build_model

    arch = models.resolve(preset, {"seq_length": WIDTH})
    torch.manual_seed(4)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    gpt, _ = build_model(arch, VOCAB, fused_loss="eager")
    return gpt.eval()


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_packed_rows_equal_examples_alone(rt, preset: str) -> None:
    gpt = _model(preset)
    exs = _examples(14, seed=9)
    rows = ds.pack(exs, WIDTH, seed=1)
    assert sorted(i for r in rows for i in r) == list(range(len(exs)))  # every example once
    assert all(sum(len(exs[i].ids) - 1 for i in r) <= WIDTH for r in rows)
    assert len(rows) < len(exs) and max(map(len, rows)) > 1  # it does pack

    b = ds.collate_packed([[exs[i] for i in r] for r in rows], WIDTH, 0, answer_only_loss=True)
    mask = ds.packed_attention_mask(b.pop("segment_ids"))
    with torch.no_grad():
        packed = gpt(b["tokens"], b["position_ids"], mask, labels=b["labels"])
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                alone = ds.collate([exs[i]], 0, answer_only_loss=True)
                loss = gpt(alone["tokens"], alone["position_ids"], None, labels=alone["labels"])
                n = len(exs[i].ids) - 1
                m = alone["loss_mask"][0, :n].bool()
                assert torch.equal(b["loss_mask"][r, at : at + n].bool(), m)
                torch.testing.assert_close(packed[r, at : at + n][m], loss[0, :n][m], atol=2e-5, rtol=1e-5)
                at += n
    assert int(b["loss_mask"].sum()) == sum(len(e.answer) for e in exs)


def test_flex_block_mask_gives_the_dense_masks_losses(rt) -> None:
    """examples.packed_attention: flex (the rows' segment ids -> FlexAttention's block mask, eager on the CPU)
    computes the dense mask's per-token losses, fp32, on a GQA Llama. (FlexAttention has no backward on the CPU:
    the gradients are the GPU benchmark's to compare, and a CPU fine-tune with flex is refused.)"""
    from snakellm.models.attention import _BLOCK_MASKS

    gpt = _model("tiny-llama")
    exs = _examples(14, seed=5)
    rows = ds.pack(exs, WIDTH, seed=2)
    b = ds.collate_packed([[exs[i] for i in r] for r in rows], WIDTH, 0, answer_only_loss=True)
    seg = b.pop("segment_ids")
    with torch.no_grad():
        dense = gpt(b["tokens"], b["position_ids"], ds.packed_attention_mask(seg), labels=b["labels"])
        flex = gpt(b["tokens"], b["position_ids"], ds.packed_segments(seg), labels=b["labels"])
    m = b["loss_mask"].bool()
    torch.testing.assert_close(flex[m], dense[m], atol=1e-5, rtol=1e-5)
    assert len(_BLOCK_MASKS) == 1  # one block mask for the batch, shared by every layer
    ((_, bm),) = _BLOCK_MASKS.values()
    assert bm.shape[-2:] == (WIDTH, WIDTH)


def test_varlen_segments_are_the_dense_masks_attention() -> None:
    """examples.packed_attention: varlen turns the rows' segment ids into flash variable-length attention's
    cumulative lengths (a sequence per example, padding its own, never across rows) and megatron's layouts; with
    the kernel's contract computed on the CPU it gives the dense mask's attention (GQA, fp32). The kernel itself
    runs on CUDA only: scripts/bench_finetune_gpu.py --chat compares its losses with flex's."""
    import torch.nn.functional as F

    from snakellm.models.attention import cu_seqlens_of, varlen_packed, varlen_reference

    exs = _examples(14, seed=7)
    rows = ds.pack(exs, WIDTH, seed=3)
    seg = ds.collate_packed([[exs[i] for i in r] for r in rows], WIDTH, 0, answer_only_loss=True)["segment_ids"]
    cu = cu_seqlens_of(ds.packed_segments(seg))
    lengths = [len(exs[i].ids) - 1 for r in rows for i in r]
    pads = [WIDTH - sum(len(exs[i].ids) - 1 for i in r) for r in rows]
    want = []
    for r, pad in zip(rows, pads):
        want += [len(exs[i].ids) - 1 for i in r] + ([pad] if pad else [])
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == len(rows) * WIDTH
    assert torch.diff(cu).tolist() == want and sum(lengths) + sum(pads) == len(rows) * WIDTH

    torch.manual_seed(0)
    b, heads, groups, d = len(rows), 4, 2, 8
    q = torch.randn(b, heads, WIDTH, d)
    k, v = torch.randn(b, groups, WIDTH, d), torch.randn(b, groups, WIDTH, d)
    dense = F.scaled_dot_product_attention(
        q, k, v, attn_mask=~ds.packed_attention_mask(seg), scale=0.3, enable_gqa=True
    )
    got = varlen_packed(q, k, v, ds.packed_segments(seg), 0.3, attn=varlen_reference)
    assert got.shape == (WIDTH, b, heads * d)  # megatron's [s, b, heads * d]
    from snakellm.models.attention import _BLOCK_MASKS

    # the cumulative lengths are computed once a micro-batch (one host sync), not once a layer
    assert [v for k, (_, v) in _BLOCK_MASKS.items() if k[-1] == "cu_seqlens"][0].tolist() == cu.tolist()
    torch.testing.assert_close(got, dense.permute(2, 0, 1, 3).reshape(WIDTH, b, heads * d), atol=1e-5, rtol=1e-5)


def test_check_varlen_gpu_smoke(capsys) -> None:
    """scripts/check_varlen_gpu.py --smoke: the GPU check's path (packed rows -> segment ids -> varlen_packed,
    forward and backward against SDPA with the dense mask) on the CPU with the kernel's contract."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "check_varlen_gpu.py"
    spec = importlib.util.spec_from_file_location("check_varlen_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == 2 and "check: PASS" in out, out
