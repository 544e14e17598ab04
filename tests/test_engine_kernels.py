"""The fused Triton decode kernels (``snakellm/serve/engine/kernels.py``) against PyTorch, on the CPU.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels' own code on CPU tensors in fp32,
so the same source that the GPU compiles is held here to the eager decoder: each kernel against
its PyTorch expression (every norm, activation, bias and residual combination, one row and the
16- and 32-row tiles), and the engine's fused decode step against the eager :class:`Generator`'s greedy
tokens and log-probabilities for a GPT-2-style model (LayerNorm, GELU, biases, learned
positions) and a Llama-style one (RMSNorm, SwiGLU, RoPE, grouped queries). On a GPU the bf16
step is checked by ``scripts/bench_generate_gpu.py`` (teacher forcing against the eager decoder).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where there is no GPU
    pytest.skip("the interpreter needs TRITON_INTERPRET=1 before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")
torch = pytest.importorskip("torch")
torch.set_num_threads(2)

from hf_helpers import tokenizer_block, train_spm  # noqa: E402
from test_engine import PROMPTS, build_gen, engine, greedy  # noqa: E402

from snakellm.serve.engine import kernels as K  # noqa: E402

F = torch.nn.functional


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def gen(request, tmp_path_factory):
    """test_engine.py's two models over a 600-piece SentencePiece vocabulary (trained on the shipped Botchan
    text in about a second) instead of GPT-2's 50,257: the interpreter then runs the fused logits over one
    1024-column block instead of 50, which took most of these tests' time (17 s of CPU a case, 4 s now).
    What the fused step is held to does not depend on the vocabulary's size; the kernels' masks over odd
    sizes are test_linear_matches_pytorch's (N=2100 over three blocks)."""
    return build_gen(request.param, tokenizer_block("sentencepiece", train_spm(tmp_path_factory.mktemp("spm"))))


def reference(x, w, bias, residual, norm, norm_w, norm_b, eps, act):
    h = x
    if norm == K.RMSNORM:
        h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    elif norm == K.LAYERNORM:
        h = F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps)
    y = F.linear(h, w, bias)
    if act == K.SWIGLU:
        a, u = y.chunk(2, dim=-1)
        y = F.silu(a) * u
    elif act == K.GELU:
        y = F.gelu(y)
    return y if residual is None else residual + y


@pytest.mark.parametrize("rows", [1, 5, 20])
@pytest.mark.parametrize(
    "norm,act,bias,res",
    [
        (K.RMSNORM, K.NONE, False, False),
        (K.RMSNORM, K.SWIGLU, False, False),
        (K.LAYERNORM, K.GELU, True, False),
        (K.LAYERNORM, K.SWIGLU, True, False),
        (K.NONE, K.NONE, False, True),
        (K.NONE, K.NONE, True, True),
    ],
)
def test_linear_matches_pytorch(rows, norm, act, bias, res):
    """Odd sizes (K=200 over 128-wide tiles, N=2100 over three 1024-wide blocks, 5 rows of the 16-row
    tile and 20 of the 32-row one): the masks hold."""
    g = torch.Generator().manual_seed(rows * 7 + norm * 3 + act)
    n_out, k = 2100, 200
    x = torch.randn(rows, k, generator=g) * 2 + 0.5
    w = torch.randn(2 * n_out if act == K.SWIGLU else n_out, k, generator=g) / k**0.5
    b = torch.randn(w.shape[0], generator=g) if bias else None
    r = torch.randn(rows, n_out, generator=g) if res else None
    nw, nb = torch.rand(k, generator=g) + 0.5, torch.randn(k, generator=g)
    kw = {"bias": b, "residual": r, "norm": norm, "norm_w": nw, "norm_b": nb, "eps": 1e-5, "act": act}
    got = K.linear(x, w, **kw)
    want = reference(x, w, b, r, norm, nw, nb if norm == K.LAYERNORM else None, 1e-5, act)
    assert got.shape == want.shape == (rows, n_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match=f"x \\[<= {K.MAX_ROWS}, K\\]"):
        K.linear(torch.zeros(K.MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        K.linear(torch.zeros(1, 8), torch.zeros(8, 4).t())


@pytest.mark.parametrize("per,d,rope", [(4, 16, True), (3, 24, True), (1, 32, False)])
def test_attend_writes_the_cache_and_matches_sdpa(per, d, rope):
    """Rows at different positions (one at 0, one past a 32-slot tile), RoPE or none, heads per group
    and head sizes that are not powers of two: the cache gets the rotated key and the value at each
    row's position, and the output is causal attention over slots 0..pos."""
    g_ = torch.Generator().manual_seed(per * 100 + d)
    B, groups, slots, length = 3, 2, 80, 64
    pos = torch.tensor([0, 37, 63])
    kv = torch.randn(2, B, groups, slots, d, generator=g_)
    before = kv.clone()
    qkv = torch.randn(B, groups * (per + 2) * d, generator=g_)
    cos = sin = None
    if rope:
        freqs = torch.arange(slots).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    out = K.attend(qkv, kv, pos, cos, sin, per, length)
    t = qkv.view(B, groups, per + 2, d)
    q, k, v = t[:, :, :per], t[:, :, per], t[:, :, per + 1]
    if rope:
        c, s = cos[pos][:, None, None], sin[pos][:, None, None]

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * c + torch.cat((-x2, x1), dim=-1) * s

        q, k = rot(q), rot(k[:, :, None])[:, :, 0]
    for b in range(B):
        p = int(pos[b])
        torch.testing.assert_close(kv[0, b, :, p], k[b], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kv[1, b, :, p], v[b], rtol=1e-6, atol=1e-6)
        keys, values = kv[0, b, :, : p + 1], kv[1, b, :, : p + 1]  # [groups, p + 1, d]
        want = F.scaled_dot_product_attention(q[b], keys, values)  # [groups, per, d]
        torch.testing.assert_close(out[b].view(groups, per, d), want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(slots, dtype=torch.bool)
    for b in range(B):
        mask = untouched.clone()
        mask[int(pos[b])] = False
        assert torch.equal(kv[:, b, :, mask], before[:, b, :, mask])  # nothing but slot pos is written


@pytest.mark.parametrize("fused_max_batch,attend_max_len", [(K.MAX_ROWS, 1024), (1, 1024), (K.MAX_ROWS, 0)])
@pytest.mark.slow  # six compiled-kernel cases, ~17 s together: the slow tier (fast-tier budget)
def test_fused_step_equals_eager(gen, fused_max_batch, attend_max_len, monkeypatch):
    """The engine's decode step through the fused kernels: the eager decoder's greedy tokens and
    log-probabilities, for three rows (the 16-row tile; with ``fused_max_batch`` 1, cuBLAS-style
    PyTorch products around the fused attention kernel) and for one (the one-row path); and with
    the rows longer than the attention kernel takes (SDPA inside the fused step)."""
    from snakellm.serve.engine import fast_decoder

    monkeypatch.setattr(fast_decoder, "ATTEND_MAX_LEN", attend_max_len)
    params = greedy(6, stop_at_eod=False, logprobs=True)
    eng = engine(gen, max_batch=4)
    eng.fast.fused = fused_max_batch  # the GPU's choice; forced here, where the interpreter runs it
    calls = []
    for name in ("_logits_fused", "_logits"):
        real = getattr(eng.fast, name)
        monkeypatch.setattr(eng.fast, name, lambda B, Lb, real=real, name=name: calls.append((name, B)) or real(B, Lb))
    attends = []
    monkeypatch.setattr(K, "attend", lambda *a, real=K.attend: attends.append(1) or real(*a))
    for prompts in (PROMPTS, PROMPTS[2:]):
        fast = eng.generate(prompts, params)
        eager = gen.generate(prompts, params)
        assert [o.ids for o in fast] == [o.ids for o in eager]
        for f, e in zip(fast, eager, strict=True):
            assert f.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    four = "_logits_fused" if fused_max_batch >= 4 else "_logits"
    assert ("_logits_fused", 1) in calls and (four, 4) in calls  # batch buckets 1 and 4 took the expected paths
    assert bool(attends) == (attend_max_len > 0)  # the attention kernel, or SDPA for rows past its length
