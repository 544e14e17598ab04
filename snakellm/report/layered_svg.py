"""A small layered-graph SVG writer: the DAG pictures when Graphviz's ``dot`` is absent.

A plain ``pip install`` brings Snakemake but not Graphviz, and the default target draws
the rule graph and the job DAG. Rather than fail (or draw nothing), ``snakellm dag``
falls back to this writer. It reads the same dot text Snakemake prints (parsed by
:func:`snakellm.report.dag.parse_dot`) and draws it the way ``dot`` does, only simpler:

* layers by longest path from the sources (an input job is always above its consumers);
* an edge spanning several layers gets a waypoint in each layer it crosses, so it is routed
  between boxes instead of through them;
* the order inside each layer by barycenter sweeps (a few down-and-up passes, keeping the
  order with the fewest crossings);
* x positions pulled towards the mean of each node's neighbours, then packed so boxes never
  overlap.

Readable, not fancy: boxes coloured as Snakemake colours them, labels one ``<text>`` per line,
grey curved edges with arrowheads, the graph's label as a title.
"""

from __future__ import annotations

import colorsys
import re
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

FONT = 12  # px
CHAR_W = 7.2  # average sans width at FONT px; labels are short, an estimate is enough
LINE_H = 15
PAD_X, PAD_Y = 10, 6
GAP_X, GAP_Y = 24, 48  # between boxes in a layer; between layers
MARGIN = 16
TITLE_H = 28


@dataclass
class Box:
    """A node to draw: a job or rule (``lines`` set) or an edge's waypoint (``lines`` empty)."""

    id: str
    lines: list[str] = field(default_factory=list)
    stroke: str = "#888888"
    dashed: bool = False
    x: float = 0.0  # centre
    y: float = 0.0  # centre

    @property
    def width(self) -> float:
        return max((len(s) for s in self.lines), default=0) * CHAR_W + 2 * PAD_X if self.lines else 0.0

    @property
    def height(self) -> float:
        return len(self.lines) * LINE_H + 2 * PAD_Y if self.lines else 0.0


def hsv_color(spec: str) -> str:
    """Snakemake's ``"h s v"`` colour (0..1 each) as ``#rrggbb``; grey if unreadable."""
    try:
        h, s, v = (float(t) for t in spec.split())
    except ValueError:
        return "#888888"
    r, g, b = colorsys.hsv_to_rgb(h, s, v)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def longest_path_layers(nodes: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Layer of each node: 0 for nodes without inputs, else one more than its deepest input.

    Kahn's topological order, so deep job DAGs need no recursion; nodes on a cycle (which
    a DAG cannot have) end up in layer 0 rather than being lost.
    """
    children: dict[str, list[str]] = {n: [] for n in nodes}
    waiting = dict.fromkeys(nodes, 0)
    for a, b in edges:
        children[a].append(b)
        waiting[b] += 1
    layer = dict.fromkeys(nodes, 0)
    ready = [n for n in nodes if waiting[n] == 0]
    while ready:
        n = ready.pop()
        for c in children[n]:
            layer[c] = max(layer[c], layer[n] + 1)
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    return layer


def add_waypoints(
    boxes: dict[str, Box], edges: list[tuple[str, str]], layer: dict[str, int]
) -> tuple[list[list[str]], list[list[str]]]:
    """Split edges spanning layers with waypoint boxes; (each edge's chain of ids, ids per layer)."""
    chains: list[list[str]] = []
    for k, (a, b) in enumerate(edges):
        chain = [a]
        for i in range(layer[a] + 1, layer[b]):
            wid = f"_w{k}_{i}"
            boxes[wid] = Box(wid)
            layer[wid] = i
            chain.append(wid)
        chains.append([*chain, b])
    rows: list[list[str]] = [[] for _ in range(max(layer.values(), default=0) + 1)]
    for n in boxes:  # boxes are in file order: the first order of each layer
        rows[layer[n]].append(n)
    return chains, rows


def _crossings(rows: list[list[str]], links: list[tuple[str, str]]) -> int:
    pos = {n: i for row in rows for i, n in enumerate(row)}
    by_row: dict[int, list[tuple[int, int]]] = {}
    row_of = {n: r for r, row in enumerate(rows) for n in row}
    for a, b in links:
        by_row.setdefault(row_of[a], []).append((pos[a], pos[b]))
    total = 0
    for pairs in by_row.values():
        for i, (a1, b1) in enumerate(pairs):
            total += sum(1 for a2, b2 in pairs[i + 1 :] if (a1 - a2) * (b1 - b2) < 0)
    return total


def order_rows(rows: list[list[str]], links: list[tuple[str, str]], sweeps: int = 8) -> list[list[str]]:
    """Reorder each layer by the mean position of its neighbours; the order with fewest crossings wins."""
    up: dict[str, list[str]] = {}
    down: dict[str, list[str]] = {}
    for a, b in links:
        down.setdefault(a, []).append(b)
        up.setdefault(b, []).append(a)
    best, best_x = [list(r) for r in rows], _crossings(rows, links)
    rows = [list(r) for r in rows]
    for sweep in range(sweeps):
        downward = sweep % 2 == 0
        span = range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)
        for r in span:
            ref = rows[r - 1] if downward else rows[r + 1]
            pos = {n: i for i, n in enumerate(ref)}
            near = up if downward else down
            keyed = []
            for i, n in enumerate(rows[r]):
                ps = [pos[m] for m in near.get(n, []) if m in pos]
                keyed.append((sum(ps) / len(ps) if ps else float(i), i, n))
            rows[r] = [n for _, _, n in sorted(keyed)]
        if (x := _crossings(rows, links)) < best_x:
            best, best_x = [list(r) for r in rows], x
    return best


def _pack(row: list[Box], want: list[float]) -> None:
    """Put the row's centres as near ``want`` as keeps them in order without overlap.

    Packing towards the right and towards the left each give a valid row; their mean is
    valid too (the separations are linear constraints) and leans neither way.
    """
    sep = [
        (row[i].width + row[i + 1].width) / 2 + (GAP_X if row[i].lines and row[i + 1].lines else GAP_X / 2)
        for i in range(len(row) - 1)
    ]
    right, left = list(want), list(want)
    for i in range(1, len(row)):
        right[i] = max(want[i], right[i - 1] + sep[i - 1])
    for i in range(len(row) - 2, -1, -1):
        left[i] = min(want[i], left[i + 1] - sep[i])
    for b, r, lt in zip(row, right, left, strict=True):
        b.x = (r + lt) / 2


def place(boxes: dict[str, Box], rows: list[list[str]], links: list[tuple[str, str]], rounds: int = 6) -> None:
    """Set each box's centre: layers top down, x pulled towards the neighbours' mean x."""
    near: dict[str, list[str]] = {}
    for a, b in links:
        near.setdefault(a, []).append(b)
        near.setdefault(b, []).append(a)
    for row in rows:
        _pack([boxes[n] for n in row], [0.0] * len(row))
    for _ in range(rounds):
        for row in rows:
            bs = [boxes[n] for n in row]
            want = [
                sum(boxes[m].x for m in near[n]) / len(near[n]) if near.get(n) else b.x
                for n, b in zip(row, bs, strict=True)
            ]
            _pack(bs, want)
    left = min((b.x - b.width / 2 for b in boxes.values()), default=0.0)
    y: float = MARGIN + TITLE_H
    for row in rows:
        h = max((boxes[n].height for n in row), default=0.0) or LINE_H
        for n in row:
            boxes[n].x += MARGIN - left
            boxes[n].y = y + h / 2
        y += h + GAP_Y


def _path(chain: list[Box]) -> str:
    """Smooth path from the bottom of the first box through the waypoints to the top of the last."""
    pts = [(chain[0].x, chain[0].y + chain[0].height / 2)]
    pts += [(b.x, b.y) for b in chain[1:-1]]
    pts.append((chain[-1].x, chain[-1].y - chain[-1].height / 2 - 2))
    d = [f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"]
    for (x1, y1), (x2, y2) in zip(pts, pts[1:], strict=False):
        ym = (y1 + y2) / 2
        d.append(f"C{x1:.1f},{ym:.1f} {x2:.1f},{ym:.1f} {x2:.1f},{y2:.1f}")
    return " ".join(d)


def _node_svg(b: Box) -> str:
    x0, y0 = b.x - b.width / 2, b.y - b.height / 2
    dash = ' stroke-dasharray="5,3"' if b.dashed else ""
    out = [
        f'<g class="node"><title>{escape(b.lines[0])}</title>',
        f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{b.width:.1f}" height="{b.height:.1f}" rx="6" ry="6" '
        f'fill="white" stroke="{b.stroke}" stroke-width="2"{dash}/>',
    ]
    for i, line in enumerate(b.lines):
        ty = y0 + PAD_Y + (i + 0.78) * LINE_H
        out.append(f'<text x="{b.x:.1f}" y="{ty:.1f}" text-anchor="middle">{escape(line)}</text>')
    out.append("</g>")
    return "\n".join(out)


def to_svg(title: str, nodes: dict[str, tuple[str, str, str]], edges: list[tuple[str, str]]) -> str:
    """The SVG document of a graph given as Snakemake's nodes ``{id: (label, color, style)}`` and edges."""
    boxes = {
        n: Box(n, label.split("\\n"), hsv_color(color), "dashed" in style) for n, (label, color, style) in nodes.items()
    }
    edges = [(a, b) for a, b in dict.fromkeys(edges) if a in boxes and b in boxes and a != b]
    layer = longest_path_layers(list(boxes), edges)
    chains, rows = add_waypoints(boxes, edges, layer)
    links = [(c[i], c[i + 1]) for c in chains for i in range(len(c) - 1)]
    rows = order_rows(rows, links)
    place(boxes, rows, links)
    width = max((b.x + b.width / 2 for b in boxes.values()), default=0.0) + MARGIN
    width = max(width, len(title) * CHAR_W + 2 * MARGIN)
    height = max((b.y + b.height / 2 for b in boxes.values()), default=0.0) + MARGIN
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="{FONT}">',
        f"<title>{escape(title)}</title>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#999999"/></marker></defs>',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2:.1f}" y="{MARGIN + 4}" text-anchor="middle" font-size="{FONT + 1}">{escape(title)}</text>',
    ]
    for c in chains:
        parts.append(
            f'<path class="edge" d="{_path([boxes[n] for n in c])}" fill="none" stroke="#999999" '
            'stroke-width="1.6" marker-end="url(#arrow)"/>'
        )
    parts += [_node_svg(b) for b in boxes.values() if b.lines]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def graph_label(header: list[str]) -> str:
    """The ``graph[label="..."]`` of a dot header (what :func:`snakellm.report.dag.add_title` adds), or ''."""
    for line in header:
        if m := re.search(r'graph\[label="([^"]*)"', line):
            return m.group(1)
    return ""
