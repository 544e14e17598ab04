"""prepare-sft (SQuAD / jsonl -> splits, quarantine) and the metrics, without torch models."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, REPO, env_with_venv

from snakellm.finetune import metrics, sft_data

SQUAD = REPO / "resources" / "squad" / "squad-dev-subset.json"


def _lines(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines()]


def test_squad_splits_deterministic_answerable_only(tmp_path: Path) -> None:
    s1 = sft_data.prepare(str(SQUAD), str(tmp_path / "a"), split="80,10,10", seed=7)
    sft_data.prepare(str(SQUAD), str(tmp_path / "b"), split="80,10,10", seed=7)
    s3 = sft_data.prepare(str(SQUAD), str(tmp_path / "c"), split="80,10,10", seed=8)
    # the shipped file: 1,407 questions, 705 answerable, 702 unanswerable (SQuAD 2.0 style), nothing broken
    assert s1["records"] == 1407 and s1["accepted"] == 705 and s1["skipped"] == {"unanswerable": 702}
    assert s1["rejected"] == 0 and s1["splits"] == {"train": 565, "validation": 70, "test": 70}
    for name in ("train", "validation", "test"):
        assert (tmp_path / "a" / f"{name}.jsonl").read_bytes() == (tmp_path / "b" / f"{name}.jsonl").read_bytes()
    assert (tmp_path / "a" / "train.jsonl").read_bytes() != (tmp_path / "c" / "train.jsonl").read_bytes()
    assert s3["splits"] == s1["splits"]
    recs = [r for n in ("train", "validation", "test") for r in _lines(tmp_path / "a" / f"{n}.jsonl")]
    assert len({r["id"] for r in recs}) == 705  # disjoint splits covering every answerable question
    src = json.loads(SQUAD.read_text())
    qa = {q["id"]: (p["context"], q) for a in src["data"] for p in a["paragraphs"] for q in p["qas"]}
    r = recs[0]
    ctx, q = qa[r["id"]]
    assert r["input"] == f"Context: {ctx} Question: {q['question']} Answer:"
    assert r["output"] == q["answers"][0]["text"] and r["answers"] == [a["text"] for a in q["answers"]]


def test_template_limit_and_jsonl_quarantine(tmp_path: Path) -> None:
    st = sft_data.prepare(str(SQUAD), str(tmp_path / "t"), template="Q: {question}\nA:", limit=20, split="1,1,0")
    assert st["splits"] == {"train": 10, "validation": 10, "test": 0}
    assert all(
        r["input"].startswith("Q: ") and r["input"].endswith("\nA:") for r in _lines(tmp_path / "t" / "train.jsonl")
    )

    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b"\n".join(
            [
                json.dumps({"q": "1+1?", "a": "2"}).encode(),
                json.dumps({"q": "capital of France?", "a": ["Paris", "paris"]}).encode(),
                b"{broken",
                json.dumps({"q": "no answer"}).encode(),
                json.dumps({"q": "", "a": "x"}).encode(),
                json.dumps({"q": "num", "a": 3}).encode(),
                json.dumps(["not", "an", "object"]).encode(),
                b"\xff\xfe",
                json.dumps({"q": "empty list", "a": []}).encode(),
            ]
        )
        + b"\n"
    )
    st = sft_data.prepare(str(src), str(tmp_path / "j"), fmt="jsonl", input_key="q", output_key="a", split="1,0,0")
    assert st["accepted"] == 2 and st["rejected"] == 7 and st["records"] == 9
    assert st["rejected_by_reason"] == {
        "empty or non-string a": 2,
        "empty or non-string q": 1,
        "missing key a": 1,
        "not a JSON object": 1,
        "not valid JSON": 1,
        "not valid UTF-8": 1,
    }
    rej = _lines(tmp_path / "j" / "rejected.jsonl")
    assert [r["where"] for r in rej][:2] == [f"{src}:3", f"{src}:4"]
    good = sorted(_lines(tmp_path / "j" / "train.jsonl"), key=lambda r: r["input"])
    assert good == [
        {"input": "1+1?", "output": "2", "answers": ["2"]},
        {"input": "capital of France?", "output": "Paris", "answers": ["Paris", "paris"]},
    ]


@pytest.mark.slow  # 1.0 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_bad_squad_records_quarantined_and_cli(tmp_path: Path) -> None:
    bad = {
        "data": [
            {
                "title": "T",
                "paragraphs": [
                    {
                        "context": "Some text.",
                        "qas": [
                            {"id": "1", "question": "ok?", "answers": [{"text": "yes"}]},
                            {"id": "2", "question": "no answers?", "answers": []},
                            {"id": "3", "question": 5, "answers": [{"text": "x"}]},
                            {"id": "4", "question": "empty", "answers": [{"text": ""}]},
                            {"id": "5", "question": "impossible", "answers": [], "is_impossible": True},
                        ],
                    },
                    {"qas": []},
                ],
            }
        ]
    }
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    out = subprocess.run(
        [str(BIN / "snakellm"), "prepare-sft", str(p), str(tmp_path / "o"), "--split", "1,0,0"],
        env=env_with_venv(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    st = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert st["accepted"] == 1 and st["skipped"] == {"unanswerable": 1} and st["rejected"] == 4
    assert st["rejected_by_reason"] == {
        "empty or non-string answer text": 1,
        "missing or non-string question": 1,
        "no answers": 1,
        "paragraph without a context string or a qas list": 1,
    }
    (tmp_path / "none.json").write_text("{}")
    out = subprocess.run(
        [str(BIN / "snakellm"), "prepare-sft", str(tmp_path / "none.json"), str(tmp_path / "o2")],
        env=env_with_venv(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "none.json" in out.stderr and "'data'" in out.stderr
    assert not (tmp_path / "o2" / "train.jsonl").exists()


def test_exact_string_match_is_raw_equality() -> None:
    # NeMo's ExactStringMatchMetric: no strip, no case folding, no normalisation
    assert metrics.exact_string_match(["France", " France", "france", "France."], ["France"] * 4) == 0.25
    assert metrics.exact_string_match([], []) == 0.0
    with pytest.raises(ValueError):
        metrics.exact_string_match(["a"], [])


def test_squad_em_f1_as_the_official_script() -> None:
    assert metrics.normalize_answer("The  Normans, of France!") == "normans of france"
    assert metrics.squad_exact("the France", "France") == 1.0
    assert metrics.squad_f1("in the 10th century", "10th and 11th centuries") == pytest.approx(
        2 / 7
    )  # "in 10th century" vs 4 gold tokens: P 1/3, R 1/4
    s = metrics.squad_scores(
        ["Denmark", "in the 10th and 11th centuries", "nothing"],
        [["Denmark, Iceland and Norway"], ["10th and 11th centuries", "in the 10th and 11th centuries"], ["something"]],
    )
    assert s["squad_exact_match"] == pytest.approx(1 / 3)
    assert s["squad_f1"] == pytest.approx((0.4 + 1.0 + 0.0) / 3)  # Denmark: P 1, R 1/4
