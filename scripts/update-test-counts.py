"""Write the suite's collected counts into docs/testing.md (tests/test_testing_doc.py checks them).

    python scripts/update-test-counts.py          # collect (pytest --collect-only), rewrite the four counts

The counts come from the collection itself (tests/timebudget.py writes them to SNAKELLM_COUNTS_JSON):
the fast tier (-m "not slow and not slurm"), the slow tests that are not Slurm tests, the Slurm tests, all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "testing.md"
PHRASES = {  # what tests/test_testing_doc.py reads, per count
    "fast": r"(the fast tier: )\d+( tests)",
    "total": r"(all )\d+( tests)",
    "slow": r"()\d+( slow tests)",
    "slurm": r"()\d+( Slurm tests)",
}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        env = dict(os.environ, SNAKELLM_COUNTS_JSON=str(out))
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            return 1
        counts = json.loads(out.read_text())
    text = DOC.read_text()
    for key, pattern in PHRASES.items():
        text, n = re.subn(pattern, rf"\g<1>{counts[key]}\g<2>", text, count=1)
        if n != 1:
            sys.stderr.write(f"update-test-counts: {DOC} has no {pattern!r}\n")
            return 1
    DOC.write_text(text)
    print(
        f"{DOC.relative_to(REPO)}: fast {counts['fast']}, slow {counts['slow']}, Slurm {counts['slurm']}, all {counts['total']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
