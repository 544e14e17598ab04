"""Where a profiled step's time goes, from the profiler's Chrome trace (``--profile-steps A:B``).

The step's wall time (from the first phase range's start to the last one's end, per profiled step) split into:

- ``compute``: the device busy with anything but communication (the union of its kernels' intervals);
- ``exposed communication``: the time communication kernels run while no compute kernel does (what overlap did
  not hide); ``communication`` is their whole time, hidden or not;
- ``optimizer``: the compute inside the step's ``optimizer`` range (the Adam step and its gradient norm);
- ``recomputation``: the compute of the layers' forward run again in the backward pass (launched from inside
  megatron-core's ``CheckpointFunctionBackward``, outside its nested backward of those layers);
- ``idle``: the rest (the device waiting on the host: launches, data, synchronisation).

On a GPU the intervals are the trace's kernels (``cat: kernel``; NCCL's are ``nccl*``) and the ranges are the
GPU-side copies of the step's phases (``gpu_user_annotation``). On the CPU (gloo) there is no device timeline:
the main thread's operators stand in for kernels and gloo's collectives (``gloo:*``) for communication, so the
same table comes out of a CPU run (the smoke), with the CPU's meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PHASES = ("zero_grad", "forward", "backward", "finalize_grads", "optimizer")
COMM = re.compile(r"^(nccl|gloo:|c10d::|record_param_comms)", re.I)
RECOMPUTE = "CheckpointFunctionBackward"

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, in order."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def minus(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of the merged intervals ``a`` outside the merged intervals ``b``."""
    out: list[Interval] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def within(a: list[Interval], windows: list[Interval]) -> list[Interval]:
    """The parts of the merged intervals ``a`` inside the merged ``windows``."""
    out: list[Interval] = []
    j = 0
    for lo, hi in a:
        while j < len(windows) and windows[j][1] <= lo:
            j += 1
        k = j
        while k < len(windows) and windows[k][0] < hi:
            a0, b0 = max(lo, windows[k][0]), min(hi, windows[k][1])
            if a0 < b0:
                out.append((a0, b0))
            k += 1
    return out


@dataclass
class Breakdown:
    steps: int
    device: str  # "GPU" or "CPU"
    step_s: float
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    optimizer_s: float
    recomputation_s: float

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.exposed_communication_s)

    def lines(self) -> list[str]:
        def pct(x: float) -> str:
            return f"{x * 1e3:9.2f} ms {x / self.step_s:6.1%}" if self.step_s else f"{x * 1e3:9.2f} ms"

        return [
            f"step breakdown ({self.device}, mean of {self.steps} profiled step{'s' if self.steps != 1 else ''}):",
            f"  step                    {pct(self.step_s)}",
            f"  compute                 {pct(self.compute_s)}  (of which optimizer {self.optimizer_s * 1e3:.2f} ms, "
            f"recomputation {self.recomputation_s * 1e3:.2f} ms)",
            f"  exposed communication   {pct(self.exposed_communication_s)}  (all communication "
            f"{self.communication_s * 1e3:.2f} ms, {self.hidden_share():.0%} of it hidden under compute)",
            f"  idle                    {pct(self.idle_s)}",
        ]

    def hidden_share(self) -> float:
        if not self.communication_s:
            return 0.0
        return 1.0 - self.exposed_communication_s / self.communication_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "device": self.device,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "exposed_communication_s": self.exposed_communication_s,
            "optimizer_s": self.optimizer_s,
            "recomputation_s": self.recomputation_s,
            "idle_s": self.idle_s,
        }


def _iv(e: dict) -> Interval:
    return float(e["ts"]) * 1e-6, (float(e["ts"]) + float(e.get("dur", 0))) * 1e-6


def breakdown(trace: dict | list, steps: int) -> Breakdown | None:
    """The mean profiled step's breakdown (None: the trace holds no step phases)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    gpu = bool(kernels)
    phase_cat = "gpu_user_annotation" if gpu else "user_annotation"
    phases = [e for e in xs if e.get("cat") == phase_cat and e.get("name") in PHASES]
    if not phases:
        return None
    span = (min(_iv(e)[0] for e in phases), max(_iv(e)[1] for e in phases))
    if gpu:
        ops = kernels
        launches = {
            e["args"]["correlation"]: _iv(e)
            for e in xs
            # cudaLaunchKernel, and the driver's cuLaunchKernel(Ex) by which cuBLAS and Triton launch theirs
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        }
    else:
        main = _main_thread(xs)
        ops = _top_level([e for e in xs if e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) == main])
        comm_ranges = [e for e in xs if e.get("cat") == "user_annotation" and COMM.match(e.get("name", ""))]
    comm_ops = [e for e in ops if COMM.match(e.get("name", ""))] + ([] if gpu else comm_ranges)
    compute_ops = [e for e in ops if not COMM.match(e.get("name", ""))]
    comm = union([_iv(e) for e in comm_ops])
    compute = minus(union([_iv(e) for e in compute_ops]), [] if gpu else comm)
    optimizer = union([_iv(e) for e in phases if e["name"] == "optimizer"])
    recompute_windows = _recomputation_windows([e for e in xs if e.get("cat") == "cpu_op"])
    if gpu:  # kernels launched from inside a recomputation's backward (by the launch's correlation id)
        recomputed = union(
            [
                _iv(k)
                for k in compute_ops
                if (lc := launches.get(k.get("args", {}).get("correlation"))) is not None
                and any(a <= lc[0] <= b for a, b in recompute_windows)
            ]
        )
    else:
        recomputed = within(compute, recompute_windows)
    n = max(1, steps)
    return Breakdown(
        steps=steps,
        device="GPU" if gpu else "CPU",
        step_s=(span[1] - span[0]) / n,
        compute_s=length(compute) / n,
        communication_s=length(comm) / n,
        exposed_communication_s=length(minus(comm, compute)) / n,
        optimizer_s=length(within(compute, optimizer)) / n,
        recomputation_s=length(recomputed) / n,
    )


def _recomputation_windows(cpu_ops: list[dict]) -> list[Interval]:
    """When the host ran a recomputed forward: inside ``CheckpointFunctionBackward`` (which recomputes the
    layers' forward, then runs their backward through a nested autograd call), outside the nested call's
    ``autograd::engine::evaluate_function`` operators (the backward of the recomputed layers)."""
    windows = union([_iv(e) for e in cpu_ops if e.get("name") == RECOMPUTE])
    nested = [
        iv
        for e in cpu_ops
        if e.get("name", "").startswith("autograd::engine::evaluate_function")
        and any(a < (iv := _iv(e))[0] and iv[1] <= b for a, b in windows)
    ]
    return minus(windows, union(nested))


def _main_thread(xs: list[dict]) -> tuple[Any, Any]:
    """The (pid, tid) whose phase ranges the step ran in: the training loop's thread."""
    for e in xs:
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES:
            return e.get("pid"), e.get("tid")
    return None, None


def _top_level(ops: list[dict]) -> list[dict]:
    """The operators not nested in another one of the same thread (their children's time is theirs)."""
    out: list[dict] = []
    end = -1.0
    for e in sorted(ops, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
        a, b = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if a >= end:
            out.append(e)
            end = b
    return out
