"""How a training command is started: ``srun`` on Slurm, ``torchrun`` or nothing locally.

The ``pretrain`` rule's shell is ``{params.launch} snakellm train ...``; this
module builds that prefix from the job's Snakemake resources and the config's
``container:`` block, so the same rule runs unchanged under every profile:

* ``resources.mpi`` set (``profiles/slurm`` sets ``mpi="srun"``): the Slurm
  plugin runs the rule's shell once, in the batch step, and the shell must start
  the ranks itself. The plugin's job step removes the ``SLURM_*`` variables that
  would tell a bare ``srun`` the job's geometry, and since Slurm 22.05 ``srun``
  does not inherit ``--cpus-per-task`` from ``sbatch`` anyway, so every count is
  spelled out: ``srun --nodes=N --ntasks=T --ntasks-per-node=T/N
  --cpus-per-task=C --kill-on-bad-exit=1``. The step gets all of the job's GPUs
  (Slurm's default for steps); each rank picks its own from ``SLURM_LOCALID``.
* no ``mpi`` resource, ``tasks`` > 1 (e.g. ``--set-resources pretrain:tasks=2``):
  ``torchrun --standalone --nnodes=1 --nproc-per-node=T --no-python``.
* otherwise: no prefix, one process.

Containers (``container: {runtime, image, mounts}``):

* ``pyxis``: flags on the inner ``srun`` (``--container-image``,
  ``--container-mounts`` with absolute paths, ``--no-container-mount-home``,
  ``--container-workdir``). pyxis is an ``srun`` plugin, so without ``mpi="srun"``
  (the local profile) the command runs on the host.
* ``apptainer``: ``apptainer exec --nv --bind ... --pwd ... IMAGE`` around the
  command, inside ``srun`` (one container per rank) or around ``torchrun``.

The working directory is always mounted at the same path and made the
container's working directory: the rule's relative paths (``data/...``,
``runs/...``) must mean the same files inside and outside.

The prefix is computed by a params function that takes ``resources``, which
Snakemake leaves out of its ``params`` rerun trigger: moving a finished run from
a laptop to the cluster (or changing the node count) does not retrain anything.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from snakellm.errors import ConfigError

RUNTIMES = ("none", "pyxis", "apptainer")


class LaunchConfigError(ConfigError):
    """The resources or the container block describe a launch that cannot work."""


@dataclass(frozen=True)
class Container:
    runtime: str = "none"
    image: str = ""
    mounts: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, block: Mapping[str, Any] | None) -> Container:
        block = dict(block or {})
        runtime = block.get("runtime", "none") or "none"
        if runtime not in RUNTIMES:
            raise LaunchConfigError(f"container.runtime: {runtime!r} is not one of {', '.join(RUNTIMES)}")
        image = block.get("image") or ""
        if runtime != "none" and not image:
            raise LaunchConfigError(f"container.image: required when container.runtime is {runtime}")
        mounts = block.get("mounts") or []
        if isinstance(mounts, str):
            mounts = [mounts]
        return cls(runtime, str(image), tuple(str(m) for m in mounts))


def _abs(path: str, workdir: str) -> str:
    return os.path.normpath(os.path.join(workdir, os.path.expanduser(path)))


def resolve_mounts(mounts: Sequence[str], workdir: str) -> list[tuple[str, str, str]]:
    """``SRC[:DST[:FLAGS]]`` -> ``(abs SRC, abs DST, FLAGS)``; the workdir itself comes first.

    Relative paths are taken relative to the working directory on both sides:
    since the working directory is mounted at the same path, ``data:data`` and
    ``data`` mean the same thing in and out of the container. Both runtimes
    reject relative mount paths, so nothing relative is ever passed on.
    """
    wd = os.path.normpath(workdir)
    out: list[tuple[str, str, str]] = [(wd, wd, "")]
    for spec in mounts:
        parts = spec.split(":")
        if not parts[0] or len(parts) > 3:
            raise LaunchConfigError(f"container.mounts: {spec!r} is not SRC[:DST[:FLAGS]]")
        src = _abs(parts[0], wd)
        dst = _abs(parts[1], wd) if len(parts) > 1 and parts[1] else src
        flags = parts[2] if len(parts) > 2 else ""
        if (src, dst, flags) not in out:
            out.append((src, dst, flags))
    return out


def _mount_arg(mounts: list[tuple[str, str, str]]) -> str:
    """``SRC:DST[:FLAGS],...``: pyxis requires the DST even when it equals SRC; Apptainer accepts it."""
    return ",".join(":".join(p for p in m if p) for m in mounts)


def _int_resource(resources: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    value = resources.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            raise LaunchConfigError(f"resources.{name}: {value!r} is not an integer") from None
    return value


def geometry(resources: Mapping[str, Any]) -> tuple[int, int, int, int | None]:
    """``(nodes, tasks, tasks_per_node, cpus_per_task)`` from Snakemake resources.

    The Slurm plugin takes either ``tasks`` (total) or ``tasks_per_node`` for an
    MPI job, not both; either works here. Ranks must divide evenly over the
    nodes, since every node maps ``SLURM_LOCALID`` onto its own GPUs.
    """
    nodes = _int_resource(resources, "nodes", 1) or 1
    tasks = _int_resource(resources, "tasks")
    per_node = _int_resource(resources, "tasks_per_node")
    if tasks is None and per_node is None:
        tasks = nodes
    if tasks is None:
        assert per_node is not None
        tasks = nodes * per_node
    if per_node is None:
        if tasks % nodes:
            raise LaunchConfigError(f"resources: tasks={tasks} do not divide evenly over nodes={nodes}")
        per_node = tasks // nodes
    if nodes < 1 or tasks < 1 or per_node < 1 or per_node * nodes != tasks:
        raise LaunchConfigError(
            f"resources: nodes={nodes}, tasks={tasks}, tasks_per_node={per_node} do not fit together"
        )
    cpus = _int_resource(resources, "cpus_per_task")
    if cpus is not None and cpus < 1:
        cpus = None  # the plugin's "leave CPUs to the cluster" setting
    return nodes, tasks, per_node, cpus


def srun_args(resources: Mapping[str, Any], container: Container, workdir: str) -> list[str]:
    """The inner ``srun`` of an MPI-style Slurm job, every count explicit."""
    nodes, tasks, per_node, cpus = geometry(resources)
    mpi = shlex.split(str(resources.get("mpi")))
    args = [*mpi, f"--nodes={nodes}", f"--ntasks={tasks}", f"--ntasks-per-node={per_node}"]
    if cpus:
        args.append(f"--cpus-per-task={cpus}")
    args.append("--kill-on-bad-exit=1")
    if container.runtime == "pyxis":
        args += [
            f"--container-image={container.image}",
            f"--container-mounts={_mount_arg(resolve_mounts(container.mounts, workdir))}",
            "--no-container-mount-home",
            f"--container-workdir={os.path.normpath(workdir)}",
        ]
    return args


def apptainer_args(container: Container, workdir: str) -> list[str]:
    wd = os.path.normpath(workdir)
    return [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        _mount_arg(resolve_mounts(container.mounts, workdir)),
        "--pwd",
        wd,
        container.image,
    ]


def launch_args(
    resources: Mapping[str, Any],
    container: Mapping[str, Any] | Container | None = None,
    workdir: str | None = None,
) -> list[str]:
    """The words that go in front of ``snakellm train ...`` (possibly none)."""
    c = container if isinstance(container, Container) else Container.from_config(container)
    wd = os.path.abspath(workdir or os.getcwd())
    args: list[str] = []
    mpi = resources.get("mpi")
    if mpi:
        launcher = shlex.split(str(mpi))[0]
        if os.path.basename(launcher) == "srun":
            args += srun_args(resources, c, wd)
        else:  # mpirun / mpiexec: the MPI standard's -n; rank mapping reads OMPI_COMM_WORLD_*
            _, tasks, per_node, _ = geometry(resources)
            args += [*shlex.split(str(mpi)), "-n", str(tasks), "--npernode", str(per_node)]
        if c.runtime == "apptainer":
            args += apptainer_args(c, wd)
        return args
    if c.runtime == "apptainer":
        args += apptainer_args(c, wd)
    tasks = _int_resource(resources, "tasks", 1) or 1
    if tasks > 1:
        args += ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={tasks}", "--no-python"]
    return args


def launch_prefix(
    resources: Mapping[str, Any],
    container: Mapping[str, Any] | Container | None = None,
    workdir: str | None = None,
) -> str:
    """:func:`launch_args` as one shell-quoted string ("" when there is nothing to add)."""
    return shlex.join(launch_args(resources, container, workdir))
