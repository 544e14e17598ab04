"""``snakellm serve`` as a real process on 127.0.0.1: NeMo's documented curl request, the official
``openai`` client (completions, streaming, chat, logprobs/echo, errors), HTTP 4xx that name the
field, and many parallel clients without mixed answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import pytest
from hf_helpers import random_checkpoint, tokenizer_block
from serve_helpers import ServerProcess, call

pytestmark = pytest.mark.slow

NEMO_CURL = (
    '{"sentences": ["Deep learning is", "The capital of France"], "tokens_to_generate": 300, "temperature": 1.0, '
    '"add_BOS": true, "top_k": 0, "top_p": 0.9, "greedy": false, "all_probs": false, "repetition_penalty": 1.2, '
    '"min_tokens_to_generate": 2}'
)
SEQ = 128  # the tiny preset's sequence length, as the default run's
LIMITS = ("--max-prompts", "32", "--max-total-tokens", "2048", "--max-body-bytes", "65536", "--idle-timeout", "2")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    pytest.importorskip("torch")
    run = tmp_path_factory.mktemp("serve") / "run"
    random_checkpoint(run, {}, tokenizer_block("gpt2-bpe"), seed=11)
    return run


@pytest.fixture(scope="module")
def served(run_dir, tmp_path_factory):
    # started from an unrelated working directory: nothing may depend on the repository's
    s = ServerProcess(run_dir, "--quiet", "--model-name", "tiny", *LIMITS, cwd=tmp_path_factory.mktemp("elsewhere"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(served):
    return served.url


def _wait_log(served: ServerProcess, text: str, timeout: float = 10) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((line for line in list(served.log) if text in line), None)
        if hit:
            return hit
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the server log:\n{''.join(served.log[-20:])}")


def test_nemo_documented_curl_request(served):
    if not shutil.which("curl"):
        pytest.skip("curl is not installed")
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-w",
            "\n%{http_code}",
            "-X",
            "PUT",
            f"{served.url}/generate",
            "-H",
            "Content-Type: application/json",
            "-d",
            NEMO_CURL,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "200"
    r = json.loads(body)
    assert set(r) == {"sentences", "tokens", "logprob", "token_ids", "offsets"}  # no full_logprob unless all_probs
    assert r["logprob"] is None
    for prompt, sent, toks, ids, offs in zip(
        ["Deep learning is", "The capital of France"],
        r["sentences"],
        r["tokens"],
        r["token_ids"],
        r["offsets"],
        strict=True,
    ):
        assert ids[0] == 50256  # add_BOS: GPT-2's BOS is <|endoftext|>
        assert sent.startswith("<|endoftext|>" + prompt)
        assert len(toks) == len(ids) == len(offs) and offs == sorted(offs)
        # NeMo's fit: prompt + new tokens <= sequence length + 1 (the longest prompt: BOS + 4 tokens)
        assert 2 + 1 < len(ids) <= SEQ + 1
    _wait_log(served, f"tokens_to_generate 300 clipped to {SEQ + 1 - 5}")


def test_nemo_fields_logprobs_and_determinism(server):
    req = {
        "sentences": ["Hello there", "A"],
        "tokens_to_generate": 8,
        "greedy": True,
        "compute_logprob": True,
        "all_probs": True,
        "end_strings": [],
    }
    code, r = call(server, "/generate", req)
    assert code == 200
    for ids, lp, full in zip(r["token_ids"], r["logprob"], r["full_logprob"], strict=True):
        assert len(lp) == len(ids) - 1 and len(full) == len(ids) - 1 and len(full[0]) == 50257
        assert abs(full[-1][ids[-1]] - lp[-1]) < 1e-5
    code2, r2 = call(server, "/generate", req)
    assert r2["token_ids"] == r["token_ids"]
    seeded = {"sentences": ["Hello there"], "tokens_to_generate": 8, "random_seed": 5, "top_k": 50}
    assert call(server, "/generate", seeded)[1]["token_ids"] == call(server, "/generate", seeded)[1]["token_ids"]
    # end_strings stop the row (the end string is kept, as NeMo does)
    greedy = {"sentences": ["Hello there"], "tokens_to_generate": 8, "greedy": True, "end_strings": []}
    full_text = call(server, "/generate", greedy)[1]["sentences"][0]
    tail = full_text[len("Hello there") :]
    stop = tail[len(tail) // 2 : len(tail) // 2 + 2]
    cut = call(server, "/generate", {**greedy, "end_strings": [stop]})[1]["sentences"][0]
    assert cut.endswith(stop) or stop in cut[len("Hello there") :]
    assert len(cut) < len(full_text)
    # a generation that does not fit is shortened to the sequence length + 1, as NeMo does
    code, r = call(
        server, "/generate", {"sentences": ["x"], "tokens_to_generate": 10000, "greedy": True, "end_strings": []}
    )
    assert code == 200 and len(r["token_ids"][0]) == SEQ + 1


@pytest.mark.parametrize(
    "body,field",
    [
        ({"tokens_to_generate": 4}, "sentences"),
        ({"sentences": "not a list"}, "sentences"),
        ({"sentences": ["x"] * 129}, "sentences"),
        ({"sentences": ["x"], "tokens_to_generate": 0}, "tokens_to_generate"),
        ({"sentences": ["x " * 200]}, "sentences"),
        ({"sentences": ["x"], "temperature": 0}, "temperature"),
        ({"sentences": ["x"], "temperature": True}, "temperature"),
        ({"sentences": ["x"], "top_p": 1.5}, "top_p"),
        ({"sentences": ["x"], "top_k": -1}, "top_k"),
        ({"sentences": ["x"], "repetition_penalty": 0.5}, "repetition_penalty"),
        ({"sentences": ["x"], "greedy": "yes"}, "greedy"),
        ({"sentences": ["x"], "end_strings": "."}, "end_strings"),
        ({"sentences": ["x"], "random_seed": -3}, "random_seed"),
        ({"sentences": ["x"], "min_tokens_to_generate": 1.5}, "min_tokens_to_generate"),
        ({"sentences": ["x"], "task_ids": [0]}, "task_ids"),
        ({"sentences": ["x"], "neighbors": 2}, "neighbors"),
    ],
)
def test_nemo_bad_requests_are_400_naming_the_field(server, body, field):
    code, r = call(server, "/generate", body)
    assert code == 400 and r["field"] == field and field in r["error"]


def test_invalid_json_and_unknown_route(server):
    code, r = call(server, "/generate", b"{not json")
    assert code == 400 and "JSON" in r["error"]
    code, r = call(server, "/nothing", {})
    assert code == 404 and r["error"]["type"] == "not_found_error"


def _client(url: str, **kw):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300, **kw)


def test_openai_client_completions(server):
    openai, client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop") and r.usage.prompt_tokens == 4
    assert r.usage.completion_tokens == 12 or c.finish_reason == "stop"
    again = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert again.choices[0].text == c.text
    # the NeMo endpoint computes the same greedy continuation
    nemo = call(
        server,
        "/generate",
        {
            "sentences": ["Once upon a time"],
            "tokens_to_generate": 12,
            "greedy": True,
            "repetition_penalty": 1.0,
            "end_strings": [],
        },
    )[1]
    assert nemo["sentences"][0] == "Once upon a time" + c.text or c.finish_reason == "stop"
    # token-id prompts (what lm-eval sends) and lists of them give the same text
    ids = nemo["token_ids"][0][:4]
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].text == c.text
    both = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert [x.index for x in both.choices] == [0, 1] and both.choices[0].text == c.text[: len(both.choices[0].text)]
    # stop text is cut off, as OpenAI does
    if len(c.text) > 4:
        stop = c.text[2:4]
        s = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop]
        )
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
        assert c.text.startswith(s.choices[0].text)
    # several prompts, n, seed: reproducible with the seed
    r = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2, seed=1, temperature=1.0)
    assert len(r.choices) == 4 and [x.index for x in r.choices] == [0, 1, 2, 3]
    r2 = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2, seed=1, temperature=1.0)
    assert [x.text for x in r.choices] == [x.text for x in r2.choices]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 12
    # vLLM's extra fields: top_k=1 samples the argmax; a huge repetition penalty forbids every seen token
    k1 = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3, extra_body={"top_k": 1}
    )
    assert k1.choices[0].text == c.text
    rp = client.completions.create(
        model="tiny", prompt=ids, max_tokens=10, temperature=0, logprobs=0, extra_body={"repetition_penalty": 1e6}
    )
    new = rp.choices[0].logprobs.tokens
    assert len(set(new)) == len(new) == 10


def test_openai_penalties_and_logit_bias_equal_the_reference(server, run_dir):
    """presence/frequency penalties and logit_bias through the openai client = the reference computation
    (serve_helpers.reference_greedy on the same checkpoint); chat takes them too."""
    from serve_helpers import reference_greedy

    from snakellm.serve.generate import load_generator
    from snakellm.serve.sampling import visible

    _, client = _client(server)
    gen = load_generator(str(run_dir), device="cpu")
    ids = gen.tok.encode("Once upon a time")
    plain = reference_greedy(gen, ids, 8)
    for kw in (
        {"presence_penalty": 2.0, "frequency_penalty": 1.5},
        {"logit_bias": {"262": 6.0, str(plain[0]): -100}, "frequency_penalty": 2.0},
    ):
        bias = {int(k): v for k, v in kw.get("logit_bias", {}).items()}
        want = reference_greedy(
            gen, ids, 8, presence=kw.get("presence_penalty", 0.0), frequency=kw["frequency_penalty"], bias=bias
        )
        assert want != plain and gen.tok.eod_id not in want
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, **kw)
        assert r.choices[0].text == visible(gen, ids, want), kw
    forced = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=1.0,
        seed=2,
        logit_bias={"262": 100},
        presence_penalty=0.5,
    )
    assert forced.choices[0].message.content == " the" * 4


def test_openai_logprobs_and_echo(server):
    _, client = _client(server)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == "Once upon a time" and r.usage.completion_tokens == 0
    assert lp.tokens == ["Once", " upon", " a", " time"] and lp.text_offset == [0, 4, 9, 11]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) >= 3 for t in lp.top_logprobs[1:])
    # the same log-probabilities as NeMo's compute_logprob
    nemo = call(
        server,
        "/generate",
        {"sentences": ["Once upon a time"], "tokens_to_generate": 1, "greedy": True, "compute_logprob": True},
    )[1]
    assert lp.token_logprobs[1:] == pytest.approx(nemo["logprob"][0][:3], abs=1e-5)
    # generated tokens: greedy picks the most likely one, so it is the top alternative (lm-eval's is_greedy)
    g = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    glp = g.choices[0].logprobs
    assert len(glp.tokens) == 5 and "".join(glp.tokens).startswith(g.choices[0].text)
    for tok, top in zip(glp.token_logprobs, glp.top_logprobs, strict=True):
        assert tok == pytest.approx(max(top.values()), abs=1e-6)
    assert glp.text_offset[0] == len("Once upon a time")
    # echo with generation: the prompt's tokens, then the new ones; lm-eval's slice [ctxlen:-1]
    e = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == 5 and elp.token_logprobs[:4] == pytest.approx([None, *lp.token_logprobs[1:]], abs=1e-6)


def test_openai_streaming(server):
    _, client = _client(server)
    ref = client.completions.create(model="tiny", prompt="The river", max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="The river",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    # chat streams the same content as the non-streamed chat answer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_streams_are_incremental_and_equal_the_answers(server):
    """Chunks leave as tokens are made; stop strings, n, echo and chat stream what the answers hold."""
    import http.client
    from urllib.parse import urlparse

    _, client = _client(server)
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 100, "temperature": 1.0, "seed": 4}
    body["extra_body"] = {"min_tokens": 100}
    times = []
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    t0 = time.time()
    raw_body = {**body, "min_tokens": 100, "stream": True}
    del raw_body["extra_body"]
    conn.request("POST", "/v1/completions", json.dumps(raw_body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    line = ""
    while raw := r.readline():
        if raw.startswith(b"data: "):
            line = raw.decode().strip()
            times.append(time.time() - t0)
    conn.close()
    assert line == "data: [DONE]" and len(times) > 50
    # the chunks arrive spread over the generation, not in one burst after it: the decode part (first chunk to
    # last) is a clear share of the request, and most chunks arrive at their own millisecond. (Measured against
    # the request's start alone this flaked on a loaded machine, where the prefill takes most of the time.)
    decode = times[-1] - times[0]
    assert decode > 0.1 * times[-1], (times[0], times[-1])
    assert len({round(t, 3) for t in times}) > len(times) // 2, times
    ref = client.completions.create(**body)
    text = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    assert text == ref.choices[0].text
    # a stop string in the middle: held back, cut, never sent
    stop = ref.choices[0].text[20:23]
    cut = client.completions.create(**{**body, "stop": [stop]})
    got = "".join(c.choices[0].text for c in client.completions.create(**{**body, "stop": [stop]}, stream=True))
    assert got == cut.choices[0].text and stop not in got
    # n and several prompts: each choice's chunks add up to its answer; echo comes first
    many = {"model": "tiny", "prompt": ["Once", "The river"], "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 9}
    ref = client.completions.create(**many, echo=True)
    parts: dict[int, str] = {}
    for c in client.completions.create(**many, echo=True, stream=True):
        parts[c.choices[0].index] = parts.get(c.choices[0].index, "") + c.choices[0].text
    assert parts == {c.index: c.text for c in ref.choices}
    msgs = [{"role": "user", "content": "Hi"}]
    ref = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2, temperature=1.0, seed=2)
    parts = {}
    for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, n=2, temperature=1.0, seed=2, stream=True
    ):
        if c.choices:
            parts[c.choices[0].index] = parts.get(c.choices[0].index, "") + (c.choices[0].delta.content or "")
    assert parts == {c.index: c.message.content for c in ref.choices}
    # a bad streamed request gets its status, not a broken stream
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=SEQ, stream=True)


def test_openai_chat(server):
    _, client = _client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # the default template for runs trained here, as documented
    prompt = "System: You are terse.\n\nUser: Hi\n\nAssistant:"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    content = r.choices[0].logprobs.content
    assert "".join(x.token for x in content) == r.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 and x.logprob == pytest.approx(x.top_logprobs[0].logprob) for x in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    # n, stop and text parts
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=4,
        n=3,
        temperature=1.0,
        seed=2,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]


def test_openai_errors_then_the_next_request_on_the_same_client(server):
    openai, client = _client(server)
    good = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0}
    expect = client.completions.create(**good).choices[0].text
    cases = [
        (openai.BadRequestError, "max_tokens", {"max_tokens": -1}),
        (openai.BadRequestError, "max_tokens", {"max_tokens": 0}),  # 0 only with echo
        (openai.BadRequestError, "logit_bias", {"logit_bias": {"50256": -101}}),
        (openai.BadRequestError, "logit_bias", {"logit_bias": {"60000": 1}}),  # outside the vocabulary
        (openai.BadRequestError, "suffix", {"suffix": "tail"}),
        (openai.BadRequestError, "presence_penalty", {"presence_penalty": 2.5}),
        (openai.BadRequestError, "frequency_penalty", {"frequency_penalty": -2.5}),
        (openai.BadRequestError, "best_of", {"best_of": 3}),
        (openai.BadRequestError, "logprobs", {"logprobs": 50}),
        (openai.BadRequestError, "temperature", {"temperature": 3}),
        (openai.BadRequestError, "prompt", {"prompt": [[1, 2], "mixed"]}),
        (openai.BadRequestError, "prompt", {"prompt": [60000]}),
        (openai.BadRequestError, "prompt", {"prompt": ""}),
        (openai.BadRequestError, "max_tokens", {"max_tokens": SEQ}),  # prompt + max_tokens > context
        (openai.BadRequestError, "min_tokens", {"extra_body": {"min_tokens": 5}}),
        (openai.BadRequestError, "repetition_penalty", {"extra_body": {"repetition_penalty": 0.5}}),
        (openai.BadRequestError, "use_beam_search", {"extra_body": {"use_beam_search": True}}),
        (openai.NotFoundError, "model", {"model": "gpt-4"}),
        (openai.APIStatusError, "32", {"prompt": ["a"] * 9, "n": 4}),  # 413: prompts x n over --max-prompts
        (openai.APIStatusError, "2048", {"prompt": ["a " * 100] * 8, "max_tokens": 20, "n": 3}),  # 413 tokens
    ]
    for exc, word, change in cases:
        with pytest.raises(exc, match=word) as e:
            client.completions.create(**{**good, **change})
        if exc is openai.APIStatusError:
            assert e.value.status_code == 413
        else:
            assert e.value.body["param"] == word or word == "32"
        assert client.completions.create(**good).choices[0].text == expect  # the next request is served
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tool"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert client.completions.create(**good).choices[0].text == expect


def test_parallel_clients_get_their_own_answers(server):
    openai, _ = _client(server)
    prompts = [f"Prompt number {i} says" for i in range(12)]
    nemo_req = lambda p: {"sentences": [p], "tokens_to_generate": 10, "greedy": True, "end_strings": []}  # noqa: E731
    expected = {p: call(server, "/generate", nemo_req(p))[1]["sentences"][0] for p in prompts}
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    expected_oai = {
        p: client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts[:6]
    }
    results, errors = {}, []

    def nemo_worker(p):
        try:
            code, r = call(server, "/generate", nemo_req(p))
            results[("nemo", p)] = (code, r["sentences"][0])
        except Exception as e:
            errors.append(e)

    def oai_worker(p):
        try:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
            results[("oai", p)] = (200, r.choices[0].text)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=nemo_worker, args=(p,)) for p in prompts for _ in range(2)]
    threads += [threading.Thread(target=oai_worker, args=(p,)) for p in prompts[:6]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors
    assert all(results[("nemo", p)] == (200, expected[p]) for p in prompts)
    assert all(results[("oai", p)] == (200, expected_oai[p]) for p in prompts[:6])


def test_returned_text_leaves_out_special_tokens(tmp_path):
    """As vLLM's skip_special_tokens: SentencePiece's unk (which it spells ' ⁇ ') and EOD are not text."""
    from hf_helpers import train_spm

    from snakellm.serve.generate import Generator, load_tokenizer
    from snakellm.serve.sampling import special_ids, visible

    tok = load_tokenizer(tokenizer_block("sentencepiece", train_spm(tmp_path)))

    class Gen:  # what visible() uses of a Generator: its tokenizer and in-context decoding
        pass

    g = Gen()
    g.tok = tok  # type: ignore[attr-defined]
    g.continuation = lambda p, ids: Generator.continuation(g, p, ids)  # type: ignore[attr-defined]
    ids = tok.encode("the cat <unk> sat")
    unk = tok._sp.unk_id()
    assert unk in ids and unk in special_ids(tok) and tok.eod_id in special_ids(tok)
    assert "⁇" in tok.decode(ids)
    assert visible(g, tok.encode("A:"), [*ids, tok.eod_id]) == " the cat unk sat"
