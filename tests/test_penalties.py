"""presence_penalty, frequency_penalty and logit_bias (vLLM's semantics) against a reference computation.

The tiny model on the CPU (fp32): the engine (continuous batching, per-row settings) and the eager
decoder give the greedy tokens that a plain-Python application of the penalties to a full forward
gives at every step (serve_helpers.reference_greedy); the OpenAI request fields parse into them
and out-of-range values are a 400 naming the field; `snakellm generate --greedy` is the argmax of
the logits (no default repetition penalty).
"""

from __future__ import annotations

import pytest
from hf_helpers import tokenizer_block
from serve_helpers import reference_greedy

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

PROMPTS = ["The quick brown fox", "A", "It was the best of times, it was the worst of times"]
GREEDY_PROMPTS = ["It was a fine day and the day was fine", "Botchan was"]
SEED = 0


def hf_tokenizer_ids(tok: dict, text: str) -> list[int]:
    from snakellm.serve.generate import load_tokenizer

    return list(load_tokenizer(tok).encode(text))


@pytest.fixture(scope="module")
def gen():
    from snakellm.export.hf import build_for_import
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.serve.generate import Generator, load_tokenizer

    tok = tokenizer_block("gpt2-bpe")
    arch = resolve("tiny-llama", {})
    torch.manual_seed(7)
    model = build_for_import(arch, padded_vocab_size(tok["vocab_size"], arch))
    return Generator(model.eval(), arch, load_tokenizer(tok), tok["vocab_size"])


def _params(n=10, **kw):
    from snakellm.serve.generate import SamplingParams

    return SamplingParams(max_new_tokens=n, greedy=True, stop_at_eod=False, **kw)


# a random model rarely repeats a token: negative penalties and biases make repeats for the penalties to act on
CASES = [
    {"presence_penalty": -1.5},
    {"frequency_penalty": -0.8, "presence_penalty": 0.5},
    {"logit_bias": {262: 5.0, 11: -100.0}, "frequency_penalty": 2.0},
    {"logit_bias": {262: 3.0, 13: 2.9}, "presence_penalty": 1.0, "repetition_penalty": 1.3},
]


def _ref(gen, prompt, n, kw):
    return reference_greedy(
        gen,
        prompt,
        n,
        rep=kw.get("repetition_penalty", 1.0),
        presence=kw.get("presence_penalty", 0.0),
        frequency=kw.get("frequency_penalty", 0.0),
        bias=kw.get("logit_bias"),
    )


@pytest.mark.slow  # ~2 s: the slow tier (fast-tier budget)
def test_engine_and_eager_equal_the_reference(gen):
    """Each penalty set in one engine batch beside a plain greedy row: every row equals its reference."""
    from snakellm.serve.engine import Engine, EngineSettings

    ids = gen.encode(PROMPTS)
    eng = Engine(gen, EngineSettings(kv_cache_memory="64MiB"))
    plain = _params()
    for kw in CASES:
        params = _params(**kw)
        want = _ref(gen, ids[2], 10, kw)
        fast = eng.generate([ids[0], ids[2]], plain) + eng.generate([ids[2]], params)
        assert fast[2].ids == want, kw
        assert gen.generate([ids[2]], params)[0].ids == want, kw
        assert fast[0].ids == _ref(gen, ids[0], 10, {})
        assert want != _ref(gen, ids[2], 10, {}), kw  # the settings change the tokens (else this proves nothing)


@pytest.mark.slow  # 1.6 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_rows_with_different_penalties_in_one_batch(gen):
    """Requests with different settings decode in one batch; each gets its own penalties (per-row state)."""
    from snakellm.serve.engine import Engine, EngineSettings
    from snakellm.serve.engine.scheduler import Request

    ids = gen.encode(PROMPTS)
    eng = Engine(gen, EngineSettings(kv_cache_memory="64MiB"))
    reqs = [Request(ids[i % 3], _params(8, **kw)) for i, kw in enumerate([{}, *CASES])]
    for r in reqs:
        eng.add(r)
    while eng.has_work():
        eng.step()
    for i, (r, kw) in enumerate(zip(reqs, [{}, *CASES], strict=True)):
        assert r.ids == _ref(gen, ids[i % 3], 8, kw), kw


def test_penalize_per_row_equals_a_python_loop():
    """The tensor ops with per-row settings equal the formula applied entry by entry."""
    from snakellm.serve.engine.sampling import penalize

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 17, generator=g) * 3
    seen = torch.rand(3, 17, generator=g) < 0.4
    counts = torch.randint(0, 3, (3, 17), generator=g).float()
    bias = torch.randn(3, 17, generator=g)
    rep, freq, pres = torch.tensor([1.0, 1.5, 2.0]), torch.tensor([0.0, 0.5, -1.0]), torch.tensor([1.0, 0.0, 2.0])
    got = penalize(logits, bias, seen, rep[:, None], counts, freq[:, None], pres[:, None])
    for r in range(3):
        for v in range(17):
            x = float(logits[r, v]) + float(bias[r, v])
            if seen[r, v]:
                x = x / float(rep[r]) if x > 0 else x * float(rep[r])
            c = float(counts[r, v])
            x -= float(freq[r]) * c + (float(pres[r]) if c > 0 else 0.0)
            assert abs(float(got[r, v]) - x) < 1e-5


def test_logit_bias_forces_and_bans_tokens_when_sampling(gen):
    """+100 makes a token certain, -100 impossible, at temperature 1 (the draw sees the biased logits)."""
    from snakellm.serve.engine import Engine, EngineSettings
    from snakellm.serve.generate import SamplingParams

    eng = Engine(gen, EngineSettings(kv_cache_memory="64MiB"))
    forced = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_at_eod=False, logit_bias={318: 100.0})
    assert eng.generate(PROMPTS[:2], forced)[0].ids == [318] * 6
    base = SamplingParams(max_new_tokens=12, temperature=1.0, seed=4, stop_at_eod=False)
    drawn = eng.generate(PROMPTS[:1], base)[0].ids
    banned = SamplingParams(**{**base.__dict__, "logit_bias": {t: -100.0 for t in drawn}})
    assert not set(eng.generate(PROMPTS[:1], banned)[0].ids) & set(drawn)


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", "1"),
        ("frequency_penalty", -2.01),
        ("logit_bias", {"50": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"-3": 1}),
        ("logit_bias", [1]),
    ],
)
def test_openai_fields_out_of_range_are_400s_naming_them(field, value):
    from snakellm.serve.errors import APIError
    from snakellm.serve.openai_api import Limits, parse_completion

    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "x", field: value}, "m", Limits(8, 4096))
    assert e.value.status == 400 and field in str(e.value) and e.value.param == field


def test_openai_fields_parse_into_the_sampling_params():
    from snakellm.serve.chat import ChatTemplate, parse_chat
    from snakellm.serve.openai_api import Limits, parse_completion

    body = {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"50256": -100, "7": 3.5}}
    r = parse_completion({"model": "m", "prompt": "x", **body}, "m", Limits(8, 4096))
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -1.0, {50256: -100.0, 7: 3.5})
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    c = parse_chat(chat, "m", Limits(8, 4096), ChatTemplate("{{ messages[0].content }}", "test"))
    assert c.params.logit_bias == p.logit_bias and c.params.presence_penalty == 0.5


def test_logit_bias_outside_the_vocabulary_is_refused(gen):
    from snakellm.serve.engine import Engine, EngineSettings
    from snakellm.serve.generate import GenerationError

    params = _params(logit_bias={gen.vocab_size: 1.0})
    with pytest.raises(GenerationError, match="logit_bias") as e:
        Engine(gen, EngineSettings(kv_cache_memory="64MiB")).generate(PROMPTS[:1], params)
    assert e.value.field == "logit_bias"
    with pytest.raises(GenerationError, match="logit_bias"):
        gen.generate(PROMPTS[:1], params)


@pytest.mark.slow
def test_generate_greedy_is_transformers_greedy(tmp_path, capsys):
    """`snakellm generate --greedy` = transformers' greedy generate on the exported model (no default
    repetition penalty); a penalty given with it is applied (a random model's repeats need a large one)."""
    import json

    transformers = pytest.importorskip("transformers")
    from hf_helpers import random_checkpoint

    from snakellm.export.hf import export_hf
    from snakellm.models.loading import load
    from snakellm.steps.generate import main

    tok = tokenizer_block("gpt2-bpe")
    random_checkpoint(tmp_path / "run", {}, tok, seed=SEED)
    hf_dir = export_hf(load(tmp_path / "run"), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def cli(*extra: str) -> list[str]:
        out = tmp_path / "out.jsonl"
        argv = [str(tmp_path / "run"), "--device", "cpu", "--greedy", "--max-new-tokens", "16", "--out", str(out)]
        assert main([*argv, *[w for p in GREEDY_PROMPTS for w in ("--prompt", p)], *extra]) == 0
        return [json.loads(line)["completion"] for line in out.read_text().splitlines()]

    theirs = []
    for p in GREEDY_PROMPTS:
        x = torch.tensor([hf_tokenizer_ids(tok, p)])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False, pad_token_id=0)
        theirs.append(y[0, x.shape[1] :].tolist())
    from snakellm.serve.generate import load_tokenizer

    enc = load_tokenizer(tok)
    want = [enc.decode(hf_tokenizer_ids(tok, p) + ids)[len(p) :] for p, ids in zip(GREEDY_PROMPTS, theirs)]
    assert cli() == want
    assert cli("--repetition-penalty", "3") != want


def test_generate_flags_greedy_means_no_default_penalty():
    from snakellm.steps.generate import build_parser, params_from_args

    def params(*argv: str):
        return params_from_args(build_parser().parse_args(["run", *argv]))

    assert params("--greedy").repetition_penalty == 1.0
    assert params().repetition_penalty == 1.1  # sampling keeps its default
    assert params("--greedy", "--repetition-penalty", "1.3").repetition_penalty == 1.3
    assert "a repetition penalty applies only when given" in " ".join(build_parser().format_help().split())


def test_the_engine_refuses_a_model_larger_than_its_one_gpu():
    """No tensor parallelism in the engine: weights over the GPU are refused before loading, naming why."""
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.serve.generate import GenerationError, check_fits_one_gpu

    arch = resolve("llama3-8b", {})
    vocab = padded_vocab_size(128256, arch)
    check_fits_one_gpu(arch, vocab, 2, 80 * 2**30)  # 16 GB of bf16 weights on an 80 GB H100: served
    check_fits_one_gpu(arch, vocab, 2, None)  # the CPU: no check
    with pytest.raises(GenerationError, match="no tensor parallelism") as e:
        check_fits_one_gpu(arch, vocab, 2, 12 * 2**30)
    assert "15.0 GiB" in str(e.value) and e.value.field == "tensor_parallel"
