"""``snakellm why TARGET``: the settings that differ between a target's last build and now, key by key.

Snakemake's reason for a rerun after a changed setting is one line holding both command lines whole
(``Params have changed since last execution: ... before: '--style gpt2 ... --steps 300 ...' now: ...``,
2,292 characters for the tiny run), in which ``--steps 300`` -> ``--steps 400`` has to be found by eye.
The last build's command line is in Snakemake's own record of the target (``.snakemake/metadata/``, the
file name the path's urlsafe base64, as snakemake.persistence.file writes it); today's comes from
``snakemake -n -p --forcerun`` of the same target. Both are split into options and compared.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from base64 import urlsafe_b64encode
from pathlib import Path

from snakellm.errors import StepFailed, UsageError


class WhyError(StepFailed):
    pass


def recorded(target: str, directory: str | Path = ".") -> dict | None:
    """Snakemake's record of ``target``'s last build (rule, shellcmd, ...), or None where it has none."""
    b64 = urlsafe_b64encode(target.encode()).decode()
    max_len = 255
    parts = [b64[i : i + max_len - 1] for i in range(0, len(b64), max_len - 1)]
    parts = ["@" + s for s in parts[:-1]] + [parts[-1]]
    path = Path(directory, ".snakemake", "metadata", *parts)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def options(command: str) -> dict[str, list[str]]:
    """A command line as ``{option: [values]}`` (``--flag`` alone: ``[""]``; words before any option: by
    position, ``#1`` ...; a redirection ends it). Order within an option kept, so repeated ones compare."""
    words = shlex.split(re.split(r"\s2>>?\s", command)[0])
    out: dict[str, list[str]] = {}
    key, waiting, n = None, False, 0
    for w in words:
        if w.startswith("-") and not re.fullmatch(r"-[\d.]+(e-?\d+)?", w):
            key, _, value = w.partition("=")
            out.setdefault(key, [])
            if value:
                out[key].append(value)
            waiting = not value
        elif waiting and key is not None:
            out[key].append(w)
            waiting = False
        else:
            n += 1
            out[f"#{n}"] = [w]
    return {k: v or [""] for k, v in out.items()}


def differences(before: str, now: str) -> list[tuple[str, str, str]]:
    """(option, before, now) for every option whose values differ (``-``: absent), in the order of ``now``."""
    a, b = options(before), options(now)
    out = []
    for key in list(b) + [k for k in a if k not in b]:
        va, vb = a.get(key), b.get(key)
        if va != vb:
            show = lambda v: "-" if v is None else (" ".join(x or "(on)" for x in v) or "(on)")  # noqa: E731
            out.append((key, show(va), show(vb)))
    return out


def current_command(target: str, rule: str, directory: str | Path, extra: list[str]) -> str:
    """The shell command the target's rule would run now (a dry run of it, nothing built)."""
    exe = shutil.which(
        "snakemake", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if exe is None:
        raise WhyError("snakemake is not on PATH")
    # the target first: options such as --configfile take several values
    cmd = [exe, target, "-n", "-p", "--nocolor", "--forcerun", rule, "--nolock", "-d", str(directory), *extra]
    proc = subprocess.run(cmd, text=True, capture_output=True, check=False)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise WhyError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text.strip()[-3000:]}")
    # the job of this rule whose output list names the target; its "Shell command:" line
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) )", text):
        head = block.split("\n", 1)[0]
        if re.match(rf"(?:local)?(?:rule|checkpoint) {re.escape(rule)}:", head) and re.search(
            rf"output: .*(?<![\w/.-]){re.escape(target)}(?![\w/.-])", block
        ):
            m = re.search(r"^Shell command:\s*(.*)$", block, re.M)
            if m:
                return m.group(1).strip()
    raise WhyError(f"a dry run of {target} shows no shell command of rule {rule}:\n{text.strip()[-2000:]}")


def explain(target: str, directory: str | Path = ".", extra: list[str] | None = None) -> list[str]:
    """The lines ``snakellm why`` prints."""
    rec = recorded(target, directory)
    if rec is None:
        raise UsageError(f"{target}: Snakemake has no record of building it here (run snakemake first)")
    rule, before = rec.get("rule"), rec.get("shellcmd")
    if not rule or not before:
        raise UsageError(f"{target}: its record names no rule or shell command (a rule without shell:)")
    now = current_command(target, rule, directory, extra or [])
    diff = differences(before, now)
    if not diff:
        return [
            f"{target} (rule {rule}): the command line is the one of its last build; "
            f"`snakemake -n -r {target}` gives the other reasons (inputs updated, code changed)"
        ]
    width = max(len(k) for k, _, _ in diff)
    n = len(diff)
    head = f"{target} (rule {rule}): {n} setting{'s differ' if n != 1 else ' differs'} from its last build:"
    return [head] + [f"  {k:<{width}}  {a}  ->  {b}" for k, a, b in diff]
