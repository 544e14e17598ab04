"""matplotlib figures saved as SVG, atomically and byte-stable.

SVG keeps text selectable and scales in the report; ``svg.hashsalt`` and a
fixed ``Date`` make the same data give the same bytes, so a rerun that changed
nothing leaves nothing new to look at.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from snakellm.io.atomic import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def figure(width: float = 7.5, height: float = 4.0, rows: int = 1, cols: int = 1, **kwargs):
    """A new (figure, axes) with the report's style; Agg backend, no display needed."""
    import matplotlib
    from cycler import cycler

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.hashsalt": "snakellm",
            "svg.fonttype": "none",  # text stays text: searchable, sharp, small
            "font.family": "sans-serif",
            "font.sans-serif": ["Liberation Sans", "DejaVu Sans", "Arial"],
            "font.size": 10,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.prop_cycle": cycler(color=COLORS),
        }
    )
    return plt.subplots(rows, cols, figsize=(width, height), squeeze=False, **kwargs)


def save(fig: Figure, path: str | os.PathLike) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="svg", metadata={"Date": None, "Creator": "snakellm (matplotlib)"})
    plt.close(fig)


def empty_note(ax, text: str) -> None:
    """Say on the plot why it has nothing to show (better than an empty frame)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#57606a", fontsize=11)


def inline(fig: Figure) -> str:
    """The figure as an ``<svg>`` element for an HTML page (byte-stable as :func:`save`)."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "snakellm (matplotlib)"})
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]
