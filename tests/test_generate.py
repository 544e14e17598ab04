"""KV-cached generation: the same tokens as megatron-core's full forward, and every sampling control."""

from __future__ import annotations

import pytest
from hf_helpers import random_checkpoint, tokenizer_block

torch = pytest.importorskip("torch")
torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def gen(request, tmp_path_factory):
    from snakellm.models.loading import load
    from snakellm.serve.generate import Generator, load_tokenizer

    tok = tokenizer_block("gpt2-bpe")
    run = tmp_path_factory.mktemp("gen") / "run"
    over = {"rotary_base": 20000} if request.param == "tiny-llama" else {}
    random_checkpoint(run, over, tok, preset=request.param, seed=5)
    loaded = load(run)
    return Generator(loaded.model, loaded.arch, load_tokenizer(tok), tok["vocab_size"]), loaded


PROMPTS = ["The quick brown fox", "A", "It was the best of times, it was the worst of times"]


@pytest.mark.slow  # ~2 s each; the fast tier's 90 s has no room
def test_cached_greedy_equals_full_forward_greedy(gen):
    from snakellm.serve.generate import SamplingParams

    g, loaded = gen
    outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=20, greedy=True, stop_at_eod=False))
    V = g.vocab_size
    for o in outs:
        ids = list(o.prompt_ids)
        for _ in range(20):  # megatron-core's own forward over the whole sequence, every step
            x = torch.tensor([ids])
            with torch.no_grad():
                logits = loaded.model(x, torch.arange(len(ids))[None], None)[0, -1, :V]
            ids.append(int(logits.argmax()))
        assert ids[len(o.prompt_ids) :] == o.ids
    # batch of different lengths == each prompt alone
    alone = [g.generate([p], SamplingParams(max_new_tokens=20, greedy=True, stop_at_eod=False))[0].ids for p in PROMPTS]
    assert alone == [o.ids for o in outs]


@pytest.mark.slow  # 3.1 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_ptuning_prefix_equals_full_forward_with_the_prompt_encoder(gen):
    """p-tuning's virtual tokens in the cached engine (what evaluate uses) give the tokens of megatron-core's
    forward with the prompt encoder's embedding hook, in a batch of prompts of different lengths."""
    from snakellm.finetune.ptuning import PTuning, PTuningConfig
    from snakellm.serve.generate import Generator, SamplingParams

    g, loaded = gen
    w = loaded.model.embedding.word_embeddings.weight
    pt = PTuning(loaded.model, PTuningConfig(virtual_tokens=3, hidden=16, seed=2), w.size(1), w.dtype, w.device)
    try:
        with torch.no_grad():  # a trained-looking table, far from the zero-ish start
            pt.table = torch.randn(3, w.size(1), generator=torch.Generator().manual_seed(1))
        engine = Generator(loaded.model, loaded.arch, g.tok, g.vocab_size, virtual=pt.prompt())
        eod = g.tok.eod_id
        prompts = [[eod] * 3 + g.tok.encode(p) for p in PROMPTS]
        params = SamplingParams(max_new_tokens=8, greedy=True, stop_at_eod=False, logprobs=True)
        outs = engine.generate(prompts, params)
        plain = g.generate(prompts, params)
        assert max(abs(x - y) for o, q in zip(outs, plain) for x, y in zip(o.logprobs, q.logprobs)) > 1e-3
        for o in outs:
            ids, lps = list(o.prompt_ids), []
            for _ in range(8):
                with torch.no_grad():
                    logits = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, -1]
                lsm = torch.log_softmax(logits[: g.vocab_size].float(), dim=-1)
                ids.append(int(lsm.argmax()))
                lps.append(float(lsm[ids[-1]]))
            assert ids[len(o.prompt_ids) :] == o.ids
            assert lps == pytest.approx(o.logprobs, abs=1e-4)
    finally:
        pt.remove()


@pytest.mark.slow  # ~2 s each; the fast tier's 90 s has no room
def test_sampling_controls(gen):
    from snakellm.serve.generate import GenerationError, SamplingParams

    g, _ = gen
    greedy = [o.ids for o in g.generate(PROMPTS, SamplingParams(max_new_tokens=12, greedy=True, stop_at_eod=False))]
    # top-k 1 and a tiny nucleus are greedy whatever the temperature and seed
    for p in (
        SamplingParams(max_new_tokens=12, top_k=1, temperature=5.0, seed=3, stop_at_eod=False),
        SamplingParams(max_new_tokens=12, top_p=1e-6, temperature=2.0, seed=4, stop_at_eod=False),
    ):
        assert [o.ids for o in g.generate(PROMPTS, p)] == greedy
    # a seed reproduces a sample; another seed gives another one
    s = SamplingParams(max_new_tokens=16, temperature=1.5, top_k=100, top_p=0.95, seed=7, stop_at_eod=False)
    a = [o.ids for o in g.generate(PROMPTS, s)]
    assert a == [o.ids for o in g.generate(PROMPTS, s)]
    s.seed = 8
    assert a != [o.ids for o in g.generate(PROMPTS, s)]
    # top-k: every sampled token is among the k most likely at its step
    o = g.generate(
        ["Once"],
        SamplingParams(
            max_new_tokens=10, temperature=3.0, top_k=3, seed=1, stop_at_eod=False, logprobs=True, all_probs=True
        ),
    )[0]
    for tok_id, row in zip(o.ids, o.full_logprobs, strict=True):
        assert tok_id in torch.tensor(row).topk(3).indices.tolist()
    # repetition penalty: a huge one forbids any token already in the row (prompt included)
    o = g.generate(
        ["the the the the"], SamplingParams(max_new_tokens=15, greedy=True, repetition_penalty=1e6, stop_at_eod=False)
    )[0]
    assert len(set(o.ids)) == 15 and not set(o.ids) & set(o.prompt_ids)
    # max_new_tokens and the sequence length
    assert all(
        len(o.ids) == 5 for o in g.generate(PROMPTS, SamplingParams(max_new_tokens=5, greedy=True, stop_at_eod=False))
    )
    with pytest.raises(GenerationError, match="sequence length"):
        g.generate(PROMPTS, SamplingParams(max_new_tokens=1000))
    with pytest.raises(GenerationError) as e:
        g.generate(PROMPTS, SamplingParams(top_p=1.5))
    assert e.value.field == "top_p"


def test_eod_min_tokens_and_end_strings(gen):
    from snakellm.serve.generate import SamplingParams

    g, _ = gen
    eod = g.tok.eod_id
    out = g.decoder.out
    saved = out[eod].clone()
    with torch.no_grad():
        out[eod] = g.decoder.emb[: g.vocab_size].mean(0) * 0 + 50 * torch.sign(torch.ones_like(saved))  # EOD wins
    try:
        o = g.generate(["Hello"], SamplingParams(max_new_tokens=10, greedy=True))[0]
        o_min = g.generate(["Hello"], SamplingParams(max_new_tokens=10, min_new_tokens=4, greedy=True))[0]
    finally:
        with torch.no_grad():
            out[eod] = saved
    if o.ids != [eod]:
        pytest.skip("EOD could not be forced to be the argmax for this random model")
    assert o.finish_reason == "eod"
    assert len(o_min.ids) == 5 and eod not in o_min.ids[:4] and o_min.ids[4] == eod
    # end strings: stop as soon as the generated text contains one
    full = g.generate(["It was"], SamplingParams(max_new_tokens=24, greedy=True, stop_at_eod=False))[0]
    end = full.text[len(full.text) // 2 :][:3]
    cut = g.generate(["It was"], SamplingParams(max_new_tokens=24, greedy=True, stop_at_eod=False, end_strings=[end]))[
        0
    ]
    assert cut.finish_reason == "end_string" and end in cut.text and len(cut.ids) < len(full.ids)
    assert cut.ids == full.ids[: len(cut.ids)]


def test_score_matches_generation_logprobs(gen):
    from snakellm.serve.generate import SamplingParams

    g, _ = gen
    outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True, stop_at_eod=False, logprobs=True))
    rows = [o.prompt_ids + o.ids for o in outs]
    lps, _ = g.score(rows)
    for o, lp in zip(outs, lps, strict=True):
        assert len(lp) == len(o.prompt_ids) + len(o.ids) - 1
        assert max(abs(a - b) for a, b in zip(lp[-len(o.ids) :], o.logprobs, strict=True)) < 1e-4
