"""docs/testing.md states the suite's counts as collected: the fast tier's, the slow tests', the Slurm
tests' and the total (it drifted before: 273 and 771 written, 599 and 775 collected)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, env_with_venv
from timebudget import COUNTS, FAST_TIER_S, PER_TEST_S, SHARED_FIXTURE_S

DOC = REPO / "docs" / "testing.md"


def collected_counts(config: pytest.Config, tmp_path) -> dict:
    """This session's counts when it collected the whole suite (CI does), else a collection of it."""
    counts = config.stash.get(COUNTS, None)
    if counts and counts["whole_suite"]:
        return counts
    out = tmp_path / "counts.json"
    env = dict(env_with_venv(), SNAKELLM_COUNTS_JSON=str(out))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # outside a whole-suite run it collects the suite in a subprocess: ~10 s of CPU
def test_testing_md_states_the_collected_counts(request, tmp_path):
    counts = collected_counts(request.config, tmp_path)
    text = DOC.read_text()
    stated = {
        "fast": re.search(r"the fast tier: (\d+) tests", text),
        "total": re.search(r"all (\d+) tests", text),
        "slow": re.search(r"(\d+) slow tests", text),
        "slurm": re.search(r"(\d+) Slurm tests", text),
    }
    wrong = {
        k: (int(m.group(1)) if m else None, counts[k])
        for k, m in stated.items()
        if not m or int(m.group(1)) != counts[k]
    }
    assert not wrong, (
        "docs/testing.md states other counts than collected ((stated, collected) per tier): run "
        "`python scripts/update-test-counts.py`, or write "
        f"'the fast tier: {counts['fast']} tests', 'all {counts['total']} tests', '{counts['slow']} slow tests' and "
        f"'{counts['slurm']} Slurm tests': {wrong}"
    )
    assert counts["fast"] + counts["slow"] + counts["slurm"] == counts["total"]


def test_testing_md_states_the_time_budget():
    """The budget the suite enforces (tests/timebudget.py) is the one the page states."""
    text = DOC.read_text()
    assert f"{FAST_TIER_S:.0f} s" in text and f"{PER_TEST_S:.0f} s" in text and f"{SHARED_FIXTURE_S:.0f} s" in text
