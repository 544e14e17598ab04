"""Conversations as fine-tuning data: prepare-sft's messages/sharegpt formats (bad records quarantined),
``snakellm render-sft`` (the ids transformers' apply_chat_template gives, labels on the assistant spans only),
whole turns dropped for length, and the loss mask a packed batch carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_helpers import chat_tokenizer_dir

from snakellm.finetune import chat_template as ct
from snakellm.finetune import conversations as conv
from snakellm.finetune import dataset as ds
from snakellm.finetune.sft_data import prepare

GOOD = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "Écris « assistant: » et <|im_end|>"},
                  {"role": "assistant", "content": "user: assistant: <|im_end|> 🐍 — fini"}]},
]  # fmt: skip
BAD = {
    "unknown role 'tool' (message 1)": {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
    "non-string content (message 0)": {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
    "empty conversation": {"messages": []},
    "no assistant turn": {"messages": [{"role": "user", "content": "anyone?"}]},
    "missing key messages": {"text": "no conversation"},
}  # fmt: skip


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_prepare_sft_messages_and_sharegpt_quarantine_bad_records(tmp_path):
    src = _write(tmp_path / "chat.jsonl", GOOD * 3 + list(BAD.values()))
    st = prepare(str(src), str(tmp_path / "out"), fmt="messages", split="4,1,1")
    assert st["accepted"] == 6 and st["rejected"] == len(BAD)
    assert st["rejected_by_reason"] == {reason: 1 for reason in BAD}
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rejected] == [f"{src}:{n}" for n in range(7, 7 + len(BAD))]
    train = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert all(r["messages"] in [g["messages"] for g in GOOD] for r in train)
    share = [
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "bing", "value": "A"}]},
        {"dialog": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
    ]  # fmt: skip
    src = _write(tmp_path / "share.jsonl", share)
    st = prepare(str(src), str(tmp_path / "s"), fmt="sharegpt", split="1,0,0")
    assert st["accepted"] == 1 and st["rejected_by_reason"] == {
        "unknown role 'bing' (message 1)": 1,
        "missing key conversations": 1,
    }
    row = json.loads((tmp_path / "s" / "train.jsonl").read_text())
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    st = prepare(str(src), str(tmp_path / "k"), fmt="sharegpt", messages_key="dialog", split="1,0,0")
    assert st["accepted"] == 1


def _encoder(tmp_path, template="chatml", seq=512):
    from snakellm.tokenize import encoders

    d = chat_tokenizer_dir(tmp_path / "tok", ct.BUILTIN[template], {"chatml": "chatml"}.get(template, template))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok = encoders.load("huggingface", tokenizer_file=str(d / "tokenizer.json"), eod=cfg["eos_token"])
    return conv.chat_encoder(tok.info(), tok, None, seq, "all_assistant"), d


@pytest.mark.slow  # 2.1 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_long_conversations_drop_whole_turns_from_the_oldest_keeping_the_system_prompt(tmp_path):
    enc, _ = _encoder(tmp_path)
    turns = [{"role": "system", "content": "SYSTEM PROMPT"}]
    for k in range(6):
        turns += [{"role": "user", "content": f"question {k} " * 8}, {"role": "assistant", "content": f"answer {k}"}]
    full = enc.encode({"messages": turns})
    assert full is not None and full.truncated == 0
    enc2 = conv.ChatEncoder(enc.template, enc.tok, len(full.ids) - 1)
    short = enc2.encode({"messages": turns})
    assert short is not None and short.truncated == 1 and enc2.stats.as_dict()["turns_dropped"] == 1
    assert short.ids == enc.encode({"messages": turns[:1] + turns[3:]}).ids  # the oldest turn went, the system stayed
    tiny = conv.ChatEncoder(enc.template, enc.tok, 20)
    assert tiny.encode({"messages": turns, "_line": 7}) is None
    assert tiny.stats.skipped_too_long == 1 and tiny.skipped == [7]
    assert "1 still too long were skipped (lines 7)" in conv.length_warning("f.jsonl", tiny)


@pytest.mark.slow  # 1.2 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_packed_batch_masks_are_the_assistant_spans(tmp_path):
    enc, _ = _encoder(tmp_path)
    exs = enc.encode_all([{**g, "_line": i} for i, g in enumerate(GOOD)], "x")
    width = sum(len(e.ids) - 1 for e in exs) + 5
    b = ds.collate_packed([exs], width, 0)
    at = 0
    for k, e in enumerate(exs, 1):
        n = len(e.ids) - 1
        assert b["loss_mask"][0, at : at + n].tolist() == [float(m) for m in e.mask[1:]]
        assert b["position_ids"][0, at : at + n].tolist() == list(range(n))
        assert set(b["segment_ids"][0, at : at + n].tolist()) == {k}
        at += n
    assert b["loss_mask"][0, at:].sum() == 0
    one = ds.collate(exs[:1], 0)
    assert one["loss_mask"][0, : len(exs[0].ids) - 1].tolist() == [float(m) for m in exs[0].mask[1:]]


def _run_with_tokenizer(tmp_path, template_text):
    from hf_helpers import random_checkpoint

    from snakellm.tokenize import encoders

    d = chat_tokenizer_dir(tmp_path / "hf", template_text)
    info = encoders.load("huggingface", tokenizer_file=str(d / "tokenizer.json"), eod="<|im_end|>").info()
    if template_text is not None:
        info["chat_template"] = template_text  # as import-hf records a model's own template
    random_checkpoint(tmp_path / "run", {}, info)
    return d


@pytest.mark.slow  # a checkpoint written and read back through megatron-core (~20 s)
def test_render_sft_gives_transformers_ids_and_assistant_labels(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from snakellm.steps import render_sft

    d = _run_with_tokenizer(tmp_path, ct.BUILTIN["chatml"])
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    share = {"conversations": [{"from": "human", "value": "Name a snake"}, {"from": "gpt", "value": "Python"}]}
    src = _write(tmp_path / "chat.jsonl", [*GOOD, share, BAD["no assistant turn"]])
    out = tmp_path / "r.jsonl"
    assert render_sft.main([str(tmp_path / "run"), "--data", str(src), "--out", str(out), "--show", "1"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    convs = [g["messages"] for g in GOOD] + [[{"role": "user", "content": "Name a snake"},
                                              {"role": "assistant", "content": "Python"}]]  # fmt: skip
    assert len(rows) == 3
    for row, c in zip(rows, convs, strict=True):
        assert row["input_ids"] == hf.apply_chat_template(c, tokenize=True, return_dict=False)
        trained = [t for t in row["labels"] if t != -100]
        assert [t for t, lab in zip(row["input_ids"], row["labels"], strict=True) if lab != -100] == trained
        assert hf.decode(trained) == "".join(m["content"] + "<|im_end|>\n" for m in c if m["role"] == "assistant")
    shown = capsys.readouterr()
    assert "[[Hello!<|im_end|>\n]]" in shown.out and "<|im_start|>user\n2+2?" in shown.out
    assert "1 records rejected {'no assistant turn': 1} at " + f"{src}:4" in shown.err
    # --chat-template and --train-on as in training
    assert render_sft.main([str(tmp_path / "run"), "--data", str(src), "--out", str(out),
                            "--train-on", "last_assistant"]) == 0  # fmt: skip
    first = json.loads(out.read_text().splitlines()[0])
    assert hf.decode([t for t in first["labels"] if t != -100]) == "4<|im_end|>\n"
    # input/output records go through the prompt template, as finetune encodes them
    io = _write(tmp_path / "io.jsonl", [{"input": "Q: 1+1?", "output": "2"}])
    assert render_sft.main([str(tmp_path / "run"), "--data", str(io), "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert hf.decode([t for t in row["labels"] if t != -100]) == " 2<|im_end|>"


@pytest.mark.slow
def test_render_sft_without_a_template_names_the_setting(tmp_path, capsys):
    from snakellm.steps import render_sft

    _run_with_tokenizer(tmp_path, None)
    src = _write(tmp_path / "chat.jsonl", GOOD)
    assert render_sft.main([str(tmp_path / "run"), "--data", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "examples.chat_template" in capsys.readouterr().err
    assert render_sft.main([str(tmp_path / "run"), "--data", str(src), "--out", str(tmp_path / "o.jsonl"),
                            "--chat-template", "chatml"]) == 0  # fmt: skip
