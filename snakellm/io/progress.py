"""Progress bars that behave in a terminal, in a Snakemake log file and under srun.

In a terminal tqdm redraws in place; in a log file (``2> {log}``) it would write
a line per update, so there it reports at most every 30 s. Only rank 0 of a
distributed job shows one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from tqdm import tqdm


def is_rank0() -> bool:
    """Rank 0 by the same launcher rules as training (torchrun, srun step, OpenMPI)."""
    from snakellm.launch.distributed import LaunchError, detect

    try:
        return detect().is_rank0
    except LaunchError:  # an impossible launch is reported by the step itself; show the bar
        return True


@contextlib.contextmanager
def progress(enabled: bool = True, **kwargs) -> Iterator[tqdm]:
    tty = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.5 if tty else 30.0)
    kwargs.setdefault("dynamic_ncols", tty)
    bar = tqdm(disable=not (enabled and is_rank0()), file=sys.stderr, **kwargs)
    try:
        yield bar
    finally:
        bar.close()
