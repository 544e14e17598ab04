"""Who am I in a distributed job: rank mapping from torchrun, srun or OpenMPI.

``snakellm train`` is one command that must work alone, under ``torchrun``,
under ``srun`` (Slurm strips nothing we need from the job step's environment
here: the step itself sets ``SLURM_PROCID`` and friends) and under ``mpirun``.
This module reads the launcher's variables without importing torch, so the
batch/parallelism checks can run before anything heavy starts.

Precedence: torchrun's ``RANK``/``WORLD_SIZE`` (also what a user sets by hand),
then Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` (only inside a job *step*, i.e.
when ``SLURM_STEP_ID`` is set, so that a batch script's own environment is not
mistaken for a multi-task launch), then OpenMPI's ``OMPI_COMM_WORLD_*``.
``MASTER_ADDR`` defaults to the first host of ``SLURM_JOB_NODELIST`` (or
``SLURM_STEP_NODELIST``), ``MASTER_PORT`` to a port derived from the job id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from snakellm.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single", "torchrun", "srun", "mpirun"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


class LaunchError(UsageError, ValueError, RuntimeError):
    """A launch that cannot run: the environment describes an impossible one (rank >= world size), or the
    machine cannot run the request (no GPU for --device cuda or for tensor parallelism). Exit status 2."""


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _split_top_level(s: str) -> list[str]:
    """Split a Slurm hostlist on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise LaunchError(f"bad range {item!r} in Slurm hostlist")
            out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif item.isdigit():
            out.append(item)
        else:
            raise LaunchError(f"bad range {item!r} in Slurm hostlist")
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm hostlist syntax: ``node[01-04,07],gpu-a[1-2]-ib`` -> every host, in order.

    Handles zero padding, several bracket groups in one name (a cartesian
    product, as ``scontrol show hostnames`` does) and plain comma lists.
    """
    hosts: list[str] = []
    for part in _split_top_level(hostlist):
        names = [""]
        for m in re.finditer(r"([^\[]+)|\[([^\]]*)\]", part):
            if m.group(1) is not None:
                names = [n + m.group(1) for n in names]
            else:
                names = [n + r for n in names for r in _expand_ranges(m.group(2))]
        if "[" in part and part.count("[") != part.count("]"):
            raise LaunchError(f"unbalanced brackets in Slurm hostlist {hostlist!r}")
        hosts += names
    return hosts


def _default_port(env: Mapping[str, str]) -> int:
    """Different jobs on a shared node must not collide; the same step's tasks must agree.

    The step and the job's restart count move the port too: a step retried inside one job, or a
    requeued job, would otherwise bind the port its previous attempt's rank 0 may still hold.
    """
    job, step, restart = (env.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))
    if not job.isdigit():
        return 20000 + 9500
    offset = 101 * int(step) if step.isdigit() else 0
    offset += 1009 * int(restart) if restart.isdigit() else 0
    return 20000 + (int(job) + offset) % 20000


def detect(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size, local rank and the rendezvous address from the environment."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        launcher = "srun"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        # SLURM_TASKS_PER_NODE looks like "4(x2)" or "4,3"; the step's own count is simpler
        local_world = (
            _int(env, "SLURM_STEP_TASKS_PER_NODE") if env.get("SLURM_STEP_TASKS_PER_NODE", "").isdigit() else 0
        )
        if not local_world:
            m = re.match(r"(\d+)", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
            local_world = int(m.group(1)) if m else 1
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        launcher = "mpirun"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else 1
    else:
        launcher, rank, world, local, local_world = "single", 0, 1, 0, 1

    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"{launcher}: rank {rank} is outside world size {world}")
    if not 0 <= local < max(local_world, 1):
        raise LaunchError(f"{launcher}: local rank {local} is outside local world size {local_world}")

    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else _default_port(env)
    return DistEnv(rank, world, local, local_world, addr, port, launcher)


def export(d: DistEnv) -> None:
    """Put the torch.distributed ``env://`` variables in place for whatever launcher we came from."""
    os.environ["RANK"] = str(d.rank)
    os.environ["WORLD_SIZE"] = str(d.world_size)
    os.environ["LOCAL_RANK"] = str(d.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(d.local_world_size)
    os.environ["MASTER_ADDR"] = d.master_addr
    os.environ["MASTER_PORT"] = str(d.master_port)


def rank_table(rows: list[tuple[int, int, int, str]]) -> str:
    """Check the gathered ``(rank, local_rank, local_world_size, host)`` of every rank; one line per host.

    Each host must hold local ranks ``0 .. n-1`` exactly once, with ``n`` its own
    local world size: that is what picking a GPU by local rank relies on. A wrong
    mapping (two ranks on one GPU, a rank without one) is a :class:`LaunchError`
    here, at start-up, rather than an out-of-memory or a hang later.
    """
    hosts: dict[str, list[tuple[int, int, int]]] = {}
    for rank, local, local_world, host in sorted(rows):
        hosts.setdefault(host, []).append((rank, local, local_world))
    lines = []
    for host, items in hosts.items():
        locals_ = sorted(lo for _, lo, _ in items)
        worlds = {lw for _, _, lw in items}
        if locals_ != list(range(len(items))) or worlds != {len(items)}:
            raise LaunchError(
                f"host {host}: ranks {[r for r, _, _ in items]} have local ranks {[lo for _, lo, _ in items]} and "
                f"local world sizes {sorted(worlds)}; expected local ranks 0..{len(items) - 1} once each"
            )
        lines.append(f"{host}: ranks {','.join(str(r) for r, _, _ in items)} (local {','.join(map(str, locals_))})")
    return "; ".join(lines)
