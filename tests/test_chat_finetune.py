"""The chat fine-tuning example through Snakemake (config/examples/tiny-chat-finetune.yaml): conversations
prepared, rendered through a chat template, fully fine-tuned with the loss on the assistant replies, packed; the
held-out last replies scored before and after (docs/finetuning-and-evaluation.md quotes the numbers)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import Workspace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "examples" / "tiny-chat-finetune.yaml"
TUNED_EM = 0.7


def planned(out: str) -> dict[str, int]:
    """Jobs per rule from snakemake's 'Job stats' table."""
    table = out.split("Job stats:", 1)[1]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


@pytest.fixture(scope="module")
def chat_example(default_workflow: Workspace) -> Workspace:
    """The chat example's fine-tune and its base and tuned evaluations, built through Snakemake in the default
    workflow (a shared fixture: ~105 s alone, 118 s in CI beside the other worker, the 120 s a test has)."""
    root = default_workflow.root
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    extra = yaml.safe_load(EXAMPLE.read_text())
    cfg["sft_data"] = extra["sft_data"]
    cfg["finetune"] = extra["finetune"]
    ws = Workspace(root)
    ws.config_path = root / "config-chat.yaml"
    ws.write_config(cfg)
    ws.run("runs/tiny/eval/tiny-chat/comparison.json", timeout=1800)
    return ws


def test_chat_example_learns(chat_example: Workspace) -> None:
    ws = chat_example
    root = ws.root
    stats = json.loads((root / "data" / "sft" / "botchan-chat" / "stats.json").read_text())
    assert stats["format"] == "messages" and stats["rejected"] == 0
    summary = json.loads((root / "runs" / "tiny" / "finetune" / "tiny-chat" / "finetune_summary.json").read_text())
    assert summary["chat_template"].endswith("plain.jinja")
    enc = summary["encode"]
    assert 0 < enc["trained_tokens"] < enc["tokens"] / 3  # replies only: never the system or user text
    assert summary["sequences"] < summary["train_examples"]  # packed
    comparison = json.loads((root / "runs" / "tiny" / "eval" / "tiny-chat" / "comparison.json").read_text())
    rows = {r["metric"]: r for r in comparison["metrics"]}
    print("chat example", {k: (r["base"], r["tuned"]) for k, r in rows.items()})
    em = rows["test_exact_string_match"]
    assert em["base"] <= 0.1 and em["tuned"] >= TUNED_EM
    assert rows["test_loss"]["tuned"] < rows["test_loss"]["base"]
    preds = [
        json.loads(x) for x in (root / "runs/tiny/eval/tiny-chat/tuned/predictions.jsonl").read_text().splitlines()
    ]
    assert preds[0]["input"].endswith("Assistant:") and "Assistant: " in preds[0]["input"]

    # the template is an input of every job that renders with it: an edit reruns the fine-tune and both
    # evaluations (and what follows them), not the prepared data
    template = root / "resources" / "chat" / "plain.jinja"
    text, st = template.read_text(), template.stat()
    try:
        template.write_text(text + "{# edited #}\n")
        out = ws.run("-n", "runs/tiny/eval/tiny-chat/comparison.json")
        jobs = planned(out.stdout + out.stderr)
        assert {"finetune", "evaluate_base", "evaluate_finetune", "compare_finetune"} <= set(jobs), jobs
        assert "prepare_sft" not in jobs, jobs
    finally:
        template.write_text(text)
        os.utime(template, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = ws.run("-n", "runs/tiny/eval/tiny-chat/comparison.json")
    assert "Nothing to be done" in out.stdout + out.stderr
