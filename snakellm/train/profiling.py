"""``--profile-steps A:B``: torch.profiler over a range of steps, the kernel table to a file and the timeline
as a gzipped Chrome trace beside it (``profile-trace.json.gz``: Perfetto or ``chrome://tracing`` open it; the
step's phases are named ranges: zero_grad, forward, backward, finalize_grads, optimizer), and the step's time
split into compute, exposed communication, optimizer, recomputation and idle (snakellm.train.step_breakdown)
at the table's end and in ``profile-breakdown.json``."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from snakellm.io.atomic import write_text
from snakellm.train import step_breakdown


def parse_range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < int(m.group(1)):
        raise ValueError(f"--profile-steps {text!r}: expected A:B with 1 <= A <= B")
    return int(m.group(1)), int(m.group(2))


class StepProfiler:
    """Starts before step A, stops after step B; rank 0 writes the table sorted by device (or CPU) time."""

    def __init__(self, steps: tuple[int, int] | None, path: Path, cuda: bool, rank0: bool):
        self.steps, self.path, self.cuda, self.rank0 = steps, path, cuda, rank0
        self.prof: Any = None

    def before_step(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is None or not self.steps or step != self.steps[1]:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        if self.rank0:
            key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90)
            n = self.steps[1] - self.steps[0] + 1
            timeline = self.write_trace()
            found = step_breakdown.breakdown(timeline, n)
            lines = found.lines() if found else []
            write_text(self.path, f"torch.profiler over {n} steps, sorted by {key}\n{table}\n" + "".join(
                f"{ln}\n" for ln in lines
            ))  # fmt: skip
            if found:
                write_text(self.path.with_name("profile-breakdown.json"), json.dumps(found.as_dict(), indent=1) + "\n")
            print(table, file=sys.stderr, flush=True)
            for ln in lines:
                print(ln, file=sys.stderr, flush=True)
        self.prof = None

    def write_trace(self) -> dict:
        """The profiled steps' timeline, gzipped, next to the table (written to a temporary name, then renamed);
        returns it."""
        trace = self.path.with_name("profile-trace.json.gz")
        raw = trace.with_name(f".{trace.name}.{os.getpid()}.json")
        try:
            self.prof.export_chrome_trace(str(raw))
            data = raw.read_bytes()  # read once: parsed for the breakdown, compressed as it is
            timeline = json.loads(data)
            with gzip.open(f"{raw}.gz", "wb", compresslevel=3) as dst:
                dst.write(data)
            os.replace(f"{raw}.gz", trace)
            return timeline
        finally:
            for leftover in (raw, f"{raw}.gz"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
