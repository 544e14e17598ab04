"""``snakellm dag``: the workflow's rule graph and job DAG as SVG pictures.

Runs ``snakemake --rulegraph`` and ``snakemake --dag --forceall`` on the
workflow (any Snakemake arguments after ``--``), then Graphviz's ``dot -Tsvg``,
or, where ``dot`` is not installed (a plain ``pip install``), the built-in
layered SVG writer of :mod:`snakellm.report.layered_svg`.
The rule graph is always small. The job DAG has a node per job: a source of
60,000 shards in 75 chunks makes hundreds of them, so per-chunk jobs are
collapsed: of each run of same-rule jobs that differ only in their chunk, the
first ``--head`` and the last ``--tail`` stay, the rest become one
"… N more chunks" node with the same edges.

Snakemake labels a job with only the wildcards its inputs' jobs do not already
show (``tokenize`` under ``chunk`` shows no chunk), so a job's chunk is taken
from its own label or, failing that, from its parents: a job with exactly one
chunk among its parents' is that chunk's job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from snakellm.errors import StepFailed
from snakellm.io.atomic import atomic_path, write_text
from snakellm.report.layered_svg import graph_label, to_svg

_NODE = re.compile(r'^\s*(\w+)\[label = "((?:[^"\\]|\\.)*)", color = "([^"]*)", style="([^"]*)"\];\s*$')
_EDGE = re.compile(r"^\s*(\w+) -> (\w+)\s*$")


class DagError(StepFailed, RuntimeError):
    pass


def parse_dot(text: str) -> tuple[list[str], dict[str, tuple[str, str, str]], list[tuple[str, str]], list[str]]:
    """(header lines, {id: (label, color, style)} in order, edges, other lines) of Snakemake's dot output."""
    header: list[str] = []
    other: list[str] = []
    nodes: dict[str, tuple[str, str, str]] = {}
    edges: list[tuple[str, str]] = []
    for line in text.splitlines():
        if m := _NODE.match(line):
            nodes[m.group(1)] = (m.group(2), m.group(3), m.group(4))
        elif m := _EDGE.match(line):
            edges.append((m.group(1), m.group(2)))
        elif line.strip() and line.strip() != "}":
            (header if not nodes else other).append(line)
    if not header or not header[0].lstrip().startswith("digraph"):
        raise DagError("not Snakemake's dot output (no digraph header)")
    return header, nodes, edges, other


def _wildcards(label: str) -> tuple[str, dict[str, str]]:
    rule, *lines = label.split("\\n")
    ws = {}
    for line in lines:
        k, _, v = line.partition(": ")
        ws[k] = v
    return rule, ws


def collapse_chunks(text: str, head: int = 2, tail: int = 1) -> tuple[str, int]:
    """Snakemake dot text with runs of per-chunk jobs collapsed; (new text, jobs hidden)."""
    header, nodes, edges, _ = parse_dot(text)
    parents: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:  # a -> b: a is an input job of b
        parents.setdefault(b, []).append(a)
    parsed = {n: _wildcards(lab) for n, (lab, _, _) in nodes.items()}

    ident: dict[str, tuple[str, str] | None] = {}

    def identity(n: str, seen: frozenset = frozenset()) -> tuple[str, str] | None:
        if n in ident:
            return ident[n]
        if n in seen:  # a cycle cannot happen in a DAG; be safe
            return None
        ws = parsed[n][1]
        ps = {i for p in parents.get(n, []) if (i := identity(p, seen | {n})) is not None}
        if "chunk" in ws:
            srcs = {s for s, _ in ps}
            result: tuple[str, str] | None = (ws.get("source") or (srcs.pop() if len(srcs) == 1 else ""), ws["chunk"])
        else:
            result = ps.pop() if len(ps) == 1 else None
        ident[n] = result
        return result

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(nodes) + 1000))
    groups: dict[tuple, list[str]] = {}
    for n in nodes:
        i = identity(n)
        if i is None:
            continue
        rule, ws = parsed[n]
        rest = tuple(sorted((k, v) for k, v in ws.items() if k not in ("chunk", "source")))
        others = frozenset(p for p in parents.get(n, []) if identity(p) is None)
        groups.setdefault((rule, rest, i[0], others), []).append(n)

    rep: dict[str, str] = {}
    new_nodes: dict[str, tuple[str, str, str]] = {}
    hidden_total = 0
    group_of: dict[str, list[str]] = {}  # first member (file order) -> the group's nodes in chunk order
    for k, (key, members) in enumerate(groups.items()):
        if len(members) <= head + tail + 1:
            continue
        members.sort(key=lambda n: ident[n][1])  # type: ignore[index]
        hidden = members[head : len(members) - tail]
        pid = f"more{k}"
        first, last = ident[hidden[0]][1], ident[hidden[-1]][1]  # type: ignore[index]
        rule, rest, source, _ = key
        label = "\\n".join(
            [
                rule,
                *(f"{a}: {b}" for a, b in rest),
                *([f"source: {source}"] if source else []),
                f"… {len(hidden)} more chunks",
                f"({first} … {last})",
            ]
        )
        color = nodes[hidden[0]][1]
        new_nodes[pid] = (label, color, "rounded,dashed")
        for n in hidden:
            rep[n] = pid
        hidden_total += len(hidden)
        first_in_file = min(members, key=list(nodes).index)
        group_of[first_in_file] = members[:head] + [pid] + members[len(members) - tail :]
    out = list(header)
    grouped = {m for g in group_of.values() for m in g}
    for n in nodes:
        # a collapsed group is written together, in chunk order: first chunks, "… N more", last chunks
        for m in group_of.get(n, [] if n in grouped or n in rep else [n]):
            lab, color, style = new_nodes[m] if m in new_nodes else nodes[m]
            out.append(f'\t{m}[label = "{lab}", color = "{color}", style="{style}"];')
    seen_edges = set()
    for a, b in edges:
        e = (rep.get(a, a), rep.get(b, b))
        if e[0] != e[1] and e not in seen_edges:
            seen_edges.add(e)
            out.append(f"\t{e[0]} -> {e[1]}")
    out.append("}")
    return "\n".join(out) + "\n", hidden_total


def add_title(dot_text: str, title: str) -> str:
    safe = title.replace('"', "'")
    return re.sub(
        r"(digraph \w+ \{\n)",
        lambda m: m.group(1) + f'    graph[label="{safe}", labelloc=t, fontname=sans, fontsize=12];\n',
        dot_text,
        count=1,
    )


_warned_no_dot = False


def render(dot_text: str, out: str, fmt: str | None = None, engine: str = "auto") -> str:
    """Draw ``dot_text`` to ``out``; the engine used: ``"dot"`` (Graphviz) or ``"python"``.

    ``engine="auto"`` uses Graphviz's ``dot`` where it is on PATH and otherwise the built-in
    layered SVG writer (:mod:`snakellm.report.layered_svg`), so that a plain ``pip install``
    still completes the default target; the picture's title then says it was drawn without
    Graphviz, and one line on stderr says why.
    """
    global _warned_no_dot
    fmt = fmt or Path(out).suffix.lstrip(".") or "svg"
    dot = shutil.which("dot") if engine in ("auto", "dot") else None
    if dot is None and engine == "dot":
        raise DagError(
            "Graphviz's `dot` is not installed (bash scripts/setup-report-tools.sh, or apt-get install graphviz)"
        )
    if dot is None:
        if fmt != "svg":
            raise DagError(f"-T{fmt} needs Graphviz's `dot` (not installed); without it only .svg can be drawn")
        if not _warned_no_dot:
            print(
                "snakellm dag: Graphviz's `dot` not found; drawing with the built-in layered SVG writer",
                file=sys.stderr,
            )
            _warned_no_dot = True
        header, nodes, edges, _ = parse_dot(dot_text)
        title = graph_label(header)
        title = f"{title} (drawn without Graphviz)" if title else "drawn without Graphviz"
        write_text(out, to_svg(title, nodes, edges))
        return "python"
    with atomic_path(out) as tmp:
        proc = subprocess.run(
            [dot, f"-T{fmt}", "-o", str(tmp)], input=dot_text, text=True, capture_output=True, check=False
        )
        if proc.returncode != 0:
            raise DagError(f"dot -T{fmt} failed: {proc.stderr.strip()}")
    return "dot"


def snakemake_dot(
    what: str, snakefile: str | None, directory: str | None, config_json: str | None, extra: list[str]
) -> str:
    """The dot text of ``snakemake --rulegraph`` / ``--dag`` (every job, as if all had to run)."""
    exe = shutil.which(
        "snakemake", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if exe is None:
        raise DagError("snakemake is not on PATH")
    cmd = [exe, f"--{what}", "dot", "--forceall", "--nolock", "--quiet"]
    if snakefile:
        cmd += ["-s", snakefile]
    if directory:
        cmd += ["-d", directory]
    with tempfile.TemporaryDirectory(prefix="snakellm-dag-") as tmp:
        if config_json is not None:
            cfg = Path(tmp) / "config.json"
            cfg.write_text(config_json)
            cmd += ["--configfile", str(cfg), "--replace-workflow-config"]
        proc = subprocess.run(cmd + extra, text=True, capture_output=True, check=False)
    if proc.returncode != 0:
        raise DagError(f"{' '.join(cmd + extra)} failed ({proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    start = proc.stdout.find("digraph")
    if start < 0:
        raise DagError(f"{' '.join(cmd + extra)} printed no graph:\n{proc.stdout[-2000:]}")
    return proc.stdout[start:]
