"""The fast engine (static KV cache, capturable decode step, continuous batching) against the eager decoder.

CPU, fp32, the fast path's own code with CUDA graphs off: greedy tokens must equal the eager
:class:`Generator`'s for batches of different prompt lengths and for requests that join a running
batch mid-flight; sampling controls are checked against the model's own probabilities.
"""

from __future__ import annotations

import asyncio

import pytest
from hf_helpers import tokenizer_block

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

PROMPTS = ["The quick brown fox", "A", "It was the best of times, it was the worst of times"]


# Qwen3 (QK-norm, heads of 32 at d=64) and Qwen3-MoE (the engine's steps route like the eager decoder) in the slow
# tier: the fast tier's 90 s hold the two older styles
SLOW = [pytest.param(p, marks=pytest.mark.slow) for p in ("tiny-qwen3", "tiny-qwen3-moe")]


@pytest.fixture(scope="module", params=["tiny", "tiny-llama", *SLOW])
def gen(request):
    return build_gen(request.param, tokenizer_block("gpt2-bpe"))


def build_gen(preset: str, tok: dict):
    """A random model of ``preset`` (GPT-2, Llama or Qwen3 style: QK-norm) with non-trivial norms and biases, over
    the tokenizer block ``tok``, in an eager :class:`Generator`."""
    from snakellm.export.hf import build_for_import
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.serve.generate import Generator, load_tokenizer

    over = {"rotary_base": 20000} if preset == "tiny-llama" else {}
    arch = resolve(preset, over)
    torch.manual_seed(5)
    model = build_for_import(arch, padded_vocab_size(tok["vocab_size"], arch))
    with torch.no_grad():  # non-trivial norms and biases, so that a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    g = Generator(model.eval(), arch, load_tokenizer(tok), tok["vocab_size"])
    g.decoder_model = model  # for a second Generator over the same weights
    return g


def engine(gen, **kw):
    from snakellm.serve.engine import Engine, EngineSettings

    kw.setdefault("kv_cache_memory", "64MiB")
    return Engine(gen, EngineSettings(**kw))


def greedy(n=20, **kw):
    from snakellm.serve.generate import SamplingParams

    return SamplingParams(max_new_tokens=n, greedy=True, **kw)


@pytest.mark.slow  # 2.0 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_greedy_batch_equals_eager(gen):
    """Prompts of different lengths in one batch: the same tokens and log-probs as the eager decoder."""
    params = greedy(20, stop_at_eod=False, logprobs=True)
    fast = engine(gen).generate(PROMPTS, params)
    eager = gen.generate(PROMPTS, params)
    assert [o.ids for o in fast] == [o.ids for o in eager]
    assert [o.text for o in fast] == [o.text for o in eager]
    assert all(len(o.ids) == 20 and o.finish_reason == "length" for o in fast)
    for f, e in zip(fast, eager, strict=True):
        assert f.logprobs == pytest.approx(e.logprobs, abs=1e-4)


@pytest.mark.parametrize("pipelined", [False, True])
def test_requests_join_mid_flight_and_get_their_tokens_alone(gen, pipelined):
    """Two rows, five requests of different lengths: later ones wait, join as rows free up, and each
    gets exactly the tokens it gets alone in the eager decoder; also with the decode pipelined as on
    a GPU (tokens read one step late, a finished row computed once more and its token dropped)."""
    from snakellm.serve.engine import Request

    eng = engine(gen, max_batch=2)
    eng.pipelined = pipelined
    assert eng.fast.rows == 2
    prompts = [gen.tok.encode(p) for p in PROMPTS + ["Once upon a time", "Hello world, hello"]]
    lengths = [7, 15, 4, 12, 9]
    reqs = [eng.add(Request(p, greedy(n, stop_at_eod=False))) for p, n in zip(prompts[:2], lengths, strict=False)]
    for _ in range(3):
        eng.step()
    # the prefill's token and one per decode step; pipelined, the third step's tokens are still in flight
    assert [len(r.ids) for r in reqs] == ([3, 3] if pipelined else [4, 4])
    assert (eng.pending is not None) == pipelined
    reqs += [eng.add(Request(p, greedy(n, stop_at_eod=False))) for p, n in zip(prompts[2:], lengths[2:], strict=True)]
    seen_batches = set()
    while eng.has_work():
        eng.step()
        seen_batches.add(tuple(sorted(r.id for r in eng.running.values())))
    assert any(len(b) == 2 for b in seen_batches) and len(seen_batches) > 2  # the batch changed while running
    for r, n in zip(reqs, lengths, strict=True):
        alone = gen.generate([r.prompt], greedy(n, stop_at_eod=False))[0]
        assert r.ids == alone.ids and len(r.ids) == n and r.finish_reason == "length"
    assert sorted(eng.free) == [0, 1] and not eng.running


@pytest.mark.slow  # ~0.5 s each; the fast tier's 90 s has no room
@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_controls_equal_eager(gen, pipelined):
    """Repetition penalty, min_new_tokens with EOD, end strings: the eager decoder's tokens and reasons
    (pipelined too: a stop is seen one step late and the extra token is dropped)."""
    eod = gen.tok.eod_id
    eng = engine(gen)
    eng.pipelined = pipelined
    for params in (
        greedy(24, repetition_penalty=1.5),
        greedy(12, min_new_tokens=5),
        greedy(30, end_strings=["e"]),
    ):
        fast = eng.generate(PROMPTS, params)
        eager = gen.generate(PROMPTS, params)
        assert [(o.ids, o.finish_reason, o.text) for o in fast] == [(o.ids, o.finish_reason, o.text) for o in eager]
    # EOD made the likeliest token: stops at once, but not before min_new_tokens
    with torch.no_grad():
        saved = gen.decoder.out[eod].clone()
        gen.decoder.out[eod] = gen.decoder.out[: gen.vocab_size].mean(0) + 5 * gen.decoder.final_w.sign()
    try:
        fast = engine(gen).generate(PROMPTS, greedy(10, min_new_tokens=3))
        eager = gen.generate(PROMPTS, greedy(10, min_new_tokens=3))
        assert [(o.ids, o.finish_reason) for o in fast] == [(o.ids, o.finish_reason) for o in eager]
        assert any(o.finish_reason == "eod" for o in fast)
    finally:
        with torch.no_grad():
            gen.decoder.out[eod] = saved


def test_prompt_and_full_logprobs_equal_eager(gen):
    params = greedy(5, stop_at_eod=False, all_probs=True)
    fast = engine(gen).generate(PROMPTS, params, prompt_logprobs=True)
    eager = gen.generate(PROMPTS, params, prompt_logprobs=True)
    for f, e in zip(fast, eager, strict=True):
        assert f.prompt_logprobs == pytest.approx(e.prompt_logprobs, abs=1e-4)
        assert torch.allclose(torch.tensor(f.full_logprobs), torch.tensor(e.full_logprobs), atol=1e-4)


@pytest.mark.slow  # ~5 s for both models: the slow tier (fast-tier budget)
def test_sampling_controls(gen):
    """Seeded draws repeat alone and in a batch; top-k keeps the draws among the k likeliest tokens
    (the model's own log-probs, scored afterwards); top-k 1 and a tiny top-p are greedy."""
    from snakellm.serve.engine import Request
    from snakellm.serve.generate import SamplingParams

    eng = engine(gen)
    ids = [gen.tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=16, temperature=1.5, top_k=4, seed=7, stop_at_eod=False)
    batch = eng.generate(PROMPTS, sp)
    assert eng.generate(PROMPTS, sp) == batch
    # prompt 2 alone, with the seed prompt 2 gets in a batch (seed + 2)
    alone = eng.add(Request(ids[2], sp, seed=9))
    while eng.has_work():
        eng.step()
    assert alone.ids == batch[2].ids
    assert len({tuple(o.ids) for o in eng.generate([PROMPTS[0]] * 3, sp)}) > 1  # seed + i: rows differ
    _, full = gen.score([o.prompt_ids + o.ids for o in batch], full=True)
    for o, rows in zip(batch, full, strict=True):
        for t, row in zip(o.ids, rows[len(o.prompt_ids) - 1 :], strict=False):
            assert sorted(row, reverse=True).index(row[t]) < 4
    want = [o.ids for o in gen.generate(PROMPTS, greedy(16, stop_at_eod=False))]
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        got = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, stop_at_eod=False, seed=3, **extra))
        assert [o.ids for o in got] == want


def test_budget_admission_and_too_large(gen):
    from snakellm.errors import ConfigError
    from snakellm.serve.engine import Request, RequestTooLarge
    from snakellm.serve.engine.static_cache import parse_budget

    assert parse_budget("0.5") == ("fraction", 0.5)
    assert parse_budget("8GB") == ("bytes", 8e9) and parse_budget("2MiB") == ("bytes", 2 * 2**20)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_budget("lots")
    row = engine(gen, max_batch=1, max_seq_len=64).fast.cache.shape.row_bytes()
    eng = engine(gen, kv_cache_memory=str(3 * row + 1), max_seq_len=64)
    assert eng.fast.rows == 3 and eng.max_len == 64
    with pytest.raises(ConfigError, match="holds no row"):
        engine(gen, kv_cache_memory=str(row // 2))
    with pytest.raises(ConfigError, match="max_seq_len"):
        engine(gen, max_seq_len=10_000)
    with pytest.raises(RequestTooLarge) as e:
        eng.add(Request(list(range(60)), greedy(6)))
    assert e.value.http_status == 413 and e.value.field == "tokens_to_generate"
    edge = eng.add(Request(list(range(60)), greedy(5, stop_at_eod=False)))  # fills the row: the last token is not fed
    while eng.has_work():
        eng.step()
    assert edge.ids == gen.generate([list(range(60))], greedy(5, stop_at_eod=False))[0].ids
    reqs = [eng.add(Request(gen.tok.encode(p), greedy(6, stop_at_eod=False))) for p in PROMPTS * 2]
    eng.step()
    assert len(eng.running) == 3 and len(eng.waiting) == 3  # full: the rest wait, none fails
    while eng.has_work():
        eng.step()
    assert all(len(r.ids) == 6 for r in reqs)


@pytest.mark.parametrize("pipelined", [False, True])
def test_worker_streams_async_clients_and_cancellation(gen, pipelined):
    """Four asyncio clients stream at once through the worker thread; one cancels mid-stream."""
    from snakellm.serve.engine import EngineWorker

    eng = engine(gen, max_batch=4)
    eng.pipelined = pipelined
    worker = EngineWorker(eng)
    ids = [gen.tok.encode(p) for p in PROMPTS]
    want = gen.generate(PROMPTS, greedy(12, stop_at_eod=False))

    async def client(i):
        stream = worker.submit(ids[i], greedy(12, stop_at_eod=False))
        toks, text = [], ""
        async for ev in stream:
            if ev.token is not None:
                toks.append(ev.token)
            text += ev.text
        return toks, text, stream.request.finish_reason

    async def quitter():
        stream = worker.submit(ids[0], greedy(100, stop_at_eod=False))
        n = 0
        async for ev in stream:
            n += ev.token is not None
            if n == 3:
                stream.cancel()
        return stream.request.finish_reason, len(stream.request.ids)

    async def main():
        return await asyncio.gather(*(client(i) for i in range(3)), quitter())

    try:
        *outs, (reason, n) = asyncio.run(main())
        assert [(t, x) for t, x, _ in outs] == [(o.ids, o.text) for o in want]
        assert all(r == "length" for *_, r in outs)
        assert reason == "cancelled" and 3 <= n < 100
        # a blocking client too; and the freed rows are all back
        assert worker.submit(ids[1], greedy(12, stop_at_eod=False)).result().ids == want[1].ids
        assert sorted(worker.engine.free) == [0, 1, 2, 3]
    finally:
        worker.close()


def test_ptuning_virtual_tokens_equal_eager(gen):
    """A p-tuning prompt table (what evaluate passes) fills each prompt's first positions in the prefill."""
    from snakellm.serve.generate import Generator

    w = gen.decoder.emb
    table = torch.randn(3, w.size(1), generator=torch.Generator().manual_seed(1))
    with_prompt = Generator(gen.decoder_model, gen.arch, gen.tok, gen.vocab_size, virtual=table)
    eod = gen.tok.eod_id
    prompts = [[eod] * 3 + gen.tok.encode(p) for p in PROMPTS]
    params = greedy(8, stop_at_eod=False, logprobs=True)
    fast = engine(with_prompt).generate(prompts, params)
    eager = with_prompt.generate(prompts, params)
    assert [o.ids for o in fast] == [o.ids for o in eager]
    for f, e in zip(fast, eager, strict=True):
        assert f.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    plain = gen.generate(prompts, params)
    assert max(abs(x - y) for o, q in zip(eager, plain, strict=True) for x, y in zip(o.logprobs, q.logprobs)) > 1e-3
