"""``snakellm serve`` as a real process on 127.0.0.1: NeMo's documented curl request, the official
``openai`` client, HTTP 400s that name the field, and many parallel clients without mixed answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import env_with_venv
from hf_helpers import random_checkpoint, tokenizer_block

pytestmark = pytest.mark.slow

NEMO_CURL = (
    '{"sentences": ["Deep learning is", "The capital of France"], "tokens_to_generate": 300, "temperature": 1.0, '
    '"add_BOS": true, "top_k": 0, "top_p": 0.9, "greedy": false, "all_probs": false, "repetition_penalty": 1.2, '
    '"min_tokens_to_generate": 2}'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("serve") / "run"
    tok = tokenizer_block("gpt2-bpe")
    # seq_length 512: NeMo's documented request asks for 300 new tokens
    random_checkpoint(run, {"seq_length": 512}, tok, seed=11)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snakellm.cli",
            "serve",
            str(run),
            "--port",
            "0",
            "--threads",
            "1",
            "--quiet",
            "--model-name",
            "tiny",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_venv(),
    )
    url = None
    deadline = time.time() + 180
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if " on http://" in line:
            url = line.split(" on ", 1)[1].split()[0]
            break
    if url is None:
        proc.kill()
        raise AssertionError("server did not start:\n" + "".join(lines))
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _call(url: str, path: str, body, method: str = "PUT") -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_nemo_documented_curl_request(server):
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
            f"{server}/generate",
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
        assert 2 + 1 < len(ids) <= 1 + 4 + 300


def test_nemo_fields_logprobs_and_determinism(server):
    req = {
        "sentences": ["Hello there", "A"],
        "tokens_to_generate": 8,
        "greedy": True,
        "compute_logprob": True,
        "all_probs": True,
        "end_strings": [],
    }
    code, r = _call(server, "/generate", req)
    assert code == 200
    for ids, lp, full in zip(r["token_ids"], r["logprob"], r["full_logprob"], strict=True):
        assert len(lp) == len(ids) - 1 and len(full) == len(ids) - 1 and len(full[0]) == 50257
        assert abs(full[-1][ids[-1]] - lp[-1]) < 1e-5
    code2, r2 = _call(server, "/generate", req)
    assert r2["token_ids"] == r["token_ids"]
    seeded = {"sentences": ["Hello there"], "tokens_to_generate": 8, "random_seed": 5, "top_k": 50}
    assert _call(server, "/generate", seeded)[1]["token_ids"] == _call(server, "/generate", seeded)[1]["token_ids"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"tokens_to_generate": 4}, "sentences"),
        ({"sentences": "not a list"}, "sentences"),
        ({"sentences": ["x"] * 129}, "sentences"),
        ({"sentences": ["x"], "tokens_to_generate": 0}, "tokens_to_generate"),
        ({"sentences": ["x"], "tokens_to_generate": 10000}, "tokens_to_generate"),
        ({"sentences": ["x"], "temperature": 0}, "temperature"),
        ({"sentences": ["x"], "temperature": True}, "temperature"),
        ({"sentences": ["x"], "top_p": 1.5}, "top_p"),
        ({"sentences": ["x"], "top_k": -1}, "top_k"),
        ({"sentences": ["x"], "repetition_penalty": 0.5}, "repetition_penalty"),
        ({"sentences": ["x"], "greedy": "yes"}, "greedy"),
        ({"sentences": ["x"], "end_strings": "."}, "end_strings"),
        ({"sentences": ["x"], "random_seed": -3}, "random_seed"),
        ({"sentences": ["x"], "min_tokens_to_generate": 1.5}, "min_tokens_to_generate"),
    ],
)
def test_nemo_bad_requests_are_400_naming_the_field(server, body, field):
    code, r = _call(server, "/generate", body)
    assert code == 400 and r["field"] == field and field in r["error"]


def test_invalid_json_and_unknown_route(server):
    code, r = _call(server, "/generate", b"{not json")
    assert code == 400 and "JSON" in r["error"]
    assert _call(server, "/nothing", {})[0] == 404


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop") and r.usage.prompt_tokens == 4
    assert r.usage.completion_tokens == 12 or c.finish_reason == "stop"
    again = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert again.choices[0].text == c.text
    # the NeMo endpoint computes the same greedy continuation
    nemo = _call(
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
    # stop text is cut off, as OpenAI does
    if len(c.text) > 4:
        stop = c.text[2:4]
        s = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop]
        )
        assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
        assert c.text.startswith(s.choices[0].text)
    # several prompts, n, seed
    r = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2, seed=1, temperature=1.0)
    assert len(r.choices) == 4
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="model"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_parallel_clients_get_their_own_answers(server):
    openai = pytest.importorskip("openai")
    prompts = [f"Prompt number {i} says" for i in range(12)]
    nemo_req = lambda p: {"sentences": [p], "tokens_to_generate": 10, "greedy": True, "end_strings": []}  # noqa: E731
    expected = {p: _call(server, "/generate", nemo_req(p))[1]["sentences"][0] for p in prompts}
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    expected_oai = {
        p: client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts[:6]
    }
    results, errors = {}, []

    def nemo_worker(p):
        try:
            code, r = _call(server, "/generate", nemo_req(p))
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
