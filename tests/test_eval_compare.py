"""The fine-tune evaluation's layout and its base-vs-tuned table (torch-free parts).

The base model's evaluation is keyed by run, data set and evaluation settings, so
fine-tunes that share the three share one evaluation; the comparison refuses two
evaluations that do not measure the same thing, naming both files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snakellm.config import flags as flagmod
from snakellm.eval import compare as cmp
from snakellm.eval.evaluate import NEMO_PREDICTIONS


def _ft(**evaluate) -> dict:
    return {
        "run": "tiny",
        "data": "q",
        "method": "lora",
        "train": {"steps": 3},
        "examples": {"template": "{input} {output}"},
        "evaluate": evaluate,
    }


def test_base_evaluation_key_is_shared_and_follows_the_settings() -> None:
    a, b = _ft(tokens_to_generate=8), _ft(tokens_to_generate=8)
    b["method"], b["train"] = "full", {"steps": 100, "lr": 1.0}  # another fine-tune, same evaluation
    assert flagmod.base_eval_key(a) == flagmod.base_eval_key(b)
    assert len(flagmod.base_eval_key(a)) == 8
    assert flagmod.base_eval_key(a) != flagmod.base_eval_key(_ft(tokens_to_generate=9))
    assert flagmod.base_eval_key(a) != flagmod.base_eval_key(_ft(tokens_to_generate=8, greedy=False))
    c = _ft(tokens_to_generate=8)
    c["examples"] = {"template": "Q: {input} A: {output}"}
    assert flagmod.base_eval_key(a) != flagmod.base_eval_key(c)


def _eval_dir(d: Path, preds: list[tuple[str, str]], **metrics) -> Path:
    d.mkdir(parents=True)
    m = {"examples": len(preds), "decoding": {"greedy": True, "tokens_to_generate": 8}, "test": "t.jsonl"} | metrics
    (d / "metrics.json").write_text(json.dumps(m))
    (d / "predictions.jsonl").write_text(
        "".join(json.dumps({"input": f"q{i}", "pred": p, "label": lab}) + "\n" for i, (p, lab) in enumerate(preds))
    )
    return d


SCORES = {"test_exact_string_match": 0.0, "squad_exact_match": 0.25, "squad_f1": 0.5, "test_loss": 4.0}


def test_comparison_table(tmp_path: Path) -> None:
    base = _eval_dir(tmp_path / "base", [("x", "a"), ("b", "b"), ("y", "c"), ("z", "d")], **SCORES)
    tuned_scores = {"test_exact_string_match": 0.75, "squad_exact_match": 0.75, "squad_f1": 0.8, "test_loss": 1.5}
    tuned = _eval_dir(tmp_path / "tuned", [("a", "a"), ("x", "b"), ("c", "c"), ("d", "d")], **tuned_scores)
    c = cmp.compare(base, tuned, "ft")
    rows = {r["metric"]: r for r in c["metrics"]}
    assert list(rows) == ["test_exact_string_match", "squad_exact_match", "squad_f1", "test_loss"]
    assert rows["test_exact_string_match"]["difference"] == 0.75
    assert rows["test_loss"]["difference"] == -2.5 and not rows["test_loss"]["higher_is_better"]
    assert c["newly_exact"] == 3 and c["no_longer_exact"] == 1 and c["examples"] == 4
    assert c["predictions"][0] == {"input": "q0", "label": "a", "base": "x", "tuned": "a"}
    cmp.write(c, tmp_path / "out")
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "| test_exact_string_match | 0.0000 | 0.7500 | +0.7500 |" in md
    assert "| test_loss | 4.0000 | 1.5000 | -2.5000 |" in md
    tsv = (tmp_path / "out" / "comparison.tsv").read_text().splitlines()
    assert tsv[0] == "metric\tbase\ttuned\tdifference" and tsv[4] == "test_loss\t4.0\t1.5\t-2.5"
    assert json.loads((tmp_path / "out" / "comparison.json").read_text()) == c


def test_comparison_refuses_other_decoding(tmp_path: Path) -> None:
    base = _eval_dir(tmp_path / "base", [("a", "a")], **SCORES)
    tuned = _eval_dir(tmp_path / "tuned", [("a", "a")], **SCORES)
    m = json.loads((tuned / "metrics.json").read_text())
    m["decoding"]["tokens_to_generate"] = 16
    (tuned / "metrics.json").write_text(json.dumps(m))
    with pytest.raises(cmp.CompareError, match=r"base/metrics.json and .*tuned/metrics.json differ in decoding"):
        cmp.compare(base, tuned)


def test_nemo_predictions_file_name() -> None:
    # NeMo: f"{output_file_path_prefix}_{mode}_dataloader{idx}" + "_inputs_preds_labels.jsonl"
    assert NEMO_PREDICTIONS == "predictions" + "_test_dataloader0" + "_inputs_preds_labels.jsonl"


def test_a_dpo_fine_tunes_comparison_is_its_initial_policy_against_the_tuned_one(tmp_path: Path, capsys) -> None:
    """`snakellm compare-eval --preference SUMMARY`: the held-out pairs' rows before (test_before) and after
    (test) in the SFT comparison's three files and shape; a summary without them, or not of DPO, is refused."""
    from snakellm.steps.compare_eval import main

    before = {"pairs": 4, "reward_accuracy": 0.5, "rewards/accuracies": 0.0, "rewards/margins": 0.0}
    before |= {"logps/chosen": -20.0, "logps/rejected": -22.0, "loss": 0.6931}
    after = {"pairs": 4, "reward_accuracy": 1.0, "rewards/accuracies": 1.0, "rewards/margins": 2.5}
    after |= {"logps/chosen": -25.0, "logps/rejected": -40.0, "loss": 0.1, "reference_logps/chosen": -20.0}
    s = tmp_path / "finetune_summary.json"
    s.write_text(json.dumps({"method": "dpo", "dpo": {"beta": 0.1}, "test": after, "test_before": before}))
    assert main(["--preference", str(s), "--out-dir", str(tmp_path / "out"), "--name", "d"]) == 0
    c = json.loads((tmp_path / "out" / "comparison.json").read_text())
    assert c["examples"] == 4 and [r["metric"] for r in c["metrics"]] == [m for m, _ in cmp.PREFERENCE_METRICS]
    acc = c["metrics"][0]
    assert acc == {"metric": "reward_accuracy", "base": 0.5, "tuned": 1.0, "difference": 0.5, "higher_is_better": True}
    assert c["metrics"][4]["higher_is_better"] is False  # logps/rejected
    tsv = (tmp_path / "out" / "comparison.tsv").read_text().splitlines()
    assert tsv[0] == "metric\tbase\ttuned\tdifference" and tsv[1] == "reward_accuracy\t0.5\t1.0\t0.5"
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "(4 test pairs)" in md and "| rewards/margins | 0.0000 | 2.5000 | +2.5000 |" in md and "tie" in md
    s.write_text(json.dumps({"method": "dpo", "test": after}))
    with pytest.raises(cmp.CompareError, match="no held-out test pairs evaluated"):
        cmp.preference(s)
    s.write_text(json.dumps({"method": "lora"}))
    with pytest.raises(cmp.CompareError, match="method 'lora', not dpo"):
        cmp.preference(s)
    with pytest.raises(SystemExit):
        main(["--preference", str(s), "--base", "b", "--out-dir", str(tmp_path)])
    assert "give --base and --tuned" in capsys.readouterr().err
