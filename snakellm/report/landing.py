"""The rule graph on the landing page of ``snakemake --report``: each rule once.

Snakemake's report draws its rule graph from the job DAG's topological levels and keeps
one job per rule *per level* (``snakemake.report.rulegraph_spec``), so a rule whose jobs
sit at different depths shows up once per depth: in the default workflow the GPT-2
tokenizer's ``tokenize`` follows ``chunk`` directly and the trained SentencePiece one's
follows ``train_tokenizer``, which drew ``tokenize``, ``blend``, ``report_tokens`` and
``report_tokenizer`` twice each. :func:`install` (called by the Snakefile) replaces that
function with :func:`rulegraph_spec`: one node per rule, placed by its longest path in the
rule graph, every rule-to-rule edge once. The output has Snakemake's shape (its Vega
template draws it unchanged). If a future Snakemake moves the function, the report keeps
Snakemake's own drawing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def rule_spec(rules: Iterable[str], edges: Iterable[tuple[str, str]]) -> tuple[dict[str, list[dict]], int, int]:
    """Snakemake's (``{"nodes", "links", "links_direct"}``, xmax, ymax) for a rule graph.

    ``edges`` are (input rule, consuming rule) pairs, repeats and self-loops allowed (dropped).
    Nodes are ordered by depth (longest path from a rule with no inputs), then by name; a link
    between neighbours in that order is "direct" (Snakemake draws it straight), others curve.
    """
    names = sorted(set(rules))
    inputs: dict[str, set[str]] = {r: set() for r in names}
    for a, b in edges:
        if a != b:
            inputs.setdefault(b, set()).add(a)
            inputs.setdefault(a, set())
    depth: dict[str, int] = {}

    def depth_of(rule: str, path: frozenset[str] = frozenset()) -> int:
        if rule not in depth:
            ins = [r for r in inputs[rule] if r not in path]  # a cycle cannot happen in a DAG; be safe
            depth[rule] = 1 + max((depth_of(r, path | {rule}) for r in ins), default=-1)
        return depth[rule]

    order = sorted(inputs, key=lambda r: (depth_of(r), r))
    idx = {r: i for i, r in enumerate(order)}
    nodes: list[dict] = [{"rule": r, "fx": 10, "fy": i * 50} for i, r in enumerate(order)]
    links: list[dict] = []
    direct: list[dict] = []
    for b in order:
        for a in sorted(inputs[b], key=idx.__getitem__):
            link = {"target": idx[b], "source": idx[a], "sourcerule": a, "targetrule": b, "value": 1}
            (direct if idx[b] - idx[a] == 1 else links).append(link)
    return {"nodes": nodes, "links": links, "links_direct": direct}, 100, 50 * max(len(nodes) - 1, 0)


def rulegraph_spec(dag: Any) -> tuple[dict[str, list[dict]], int, int]:
    """:func:`rule_spec` of a Snakemake DAG (the signature of ``snakemake.report.rulegraph_spec``)."""
    rules: set[str] = set()
    edges: set[tuple[str, str]] = set()
    for level in dag.toposorted():
        for job in level:
            rules.add(job.rule.name)
            edges.update((dep.rule.name, job.rule.name) for dep in dag.dependencies[job])
    return rule_spec(rules, edges)


def install() -> bool:
    """Make ``snakemake --report`` draw :func:`rulegraph_spec`; False where this Snakemake has no such hook."""
    import sys

    try:
        import snakemake.report.rulegraph_spec as spec
    except ImportError:
        return False
    if not hasattr(spec, "rulegraph_spec"):
        return False
    # the html reporter imports the function by name: patched here before it is imported (a Snakefile
    # is parsed before the report is made), and in it where it already is
    spec.rulegraph_spec = rulegraph_spec
    html = sys.modules.get("snakemake.report.html_reporter")
    if html is not None and hasattr(html, "rulegraph_spec"):
        html.rulegraph_spec = rulegraph_spec  # type: ignore[attr-defined]
    return True
