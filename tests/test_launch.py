"""The launch prefix of the pretrain rule: exact command lines for every profile and container.

No pyxis or Apptainer runtime exists on these machines, so these lines are what is
checked for them; the ``none`` runtime under a real ``srun`` is covered end to end by
tests/test_slurm.py.
"""

from __future__ import annotations

import shlex
import subprocess

import pytest
from conftest import BIN

from snakellm.launch.prefix import Container, LaunchConfigError, geometry, launch_args, launch_prefix, resolve_mounts

WD = "/lustre/proj/snakellm"
PYXIS = {
    "runtime": "pyxis",
    "image": "nvcr.io#nvidia/pytorch:24.05-py3",
    "mounts": ["/lustre/datasets", "data:/workspace/data:ro"],
}
APPTAINER = {
    "runtime": "apptainer",
    "image": "/images/snakellm.sif",
    "mounts": ["/scratch/hf-cache:/root/.cache/huggingface"],
}

SLURM_1x2 = {"mpi": "srun", "nodes": 1, "tasks": 2, "gpu": 2, "tasks_per_gpu": 1, "cpus_per_task": 1}
SLURM_4x8 = {"mpi": "srun", "nodes": 4, "tasks": 32, "gpu": 32, "tasks_per_gpu": 1, "cpus_per_task": 8}


def test_local_single_process_has_no_prefix():
    assert launch_prefix({}, None, WD) == ""
    assert launch_prefix({"tasks": 1, "mem_mb": 1000}, {"runtime": "none"}, WD) == ""


def test_local_several_tasks_use_torchrun():
    assert launch_prefix({"tasks": 4}, None, WD) == ("torchrun --standalone --nnodes=1 --nproc-per-node=4 --no-python")


def test_slurm_single_node_two_tasks():
    assert launch_prefix(SLURM_1x2, None, WD) == (
        "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=1"
    )


def test_slurm_multi_node():
    assert launch_prefix(SLURM_4x8, {"runtime": "none"}, WD) == (
        "srun --nodes=4 --ntasks=32 --ntasks-per-node=8 --cpus-per-task=8 --kill-on-bad-exit=1"
    )


def test_slurm_tasks_per_node_instead_of_tasks():
    # the plugin takes one of tasks / tasks_per_node for an MPI job; both give the same srun
    res = {"mpi": "srun", "nodes": 2, "tasks_per_node": 4}
    assert launch_prefix(res, None, WD) == "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --kill-on-bad-exit=1"


def test_slurm_mpi_resource_with_extra_srun_flags_is_kept():
    res = dict(SLURM_1x2, mpi="srun --mpi=pmix")
    assert launch_prefix(res, None, WD).startswith("srun --mpi=pmix --nodes=1 --ntasks=2 ")


def test_pyxis_flags_go_on_the_inner_srun():
    assert launch_prefix(SLURM_4x8, PYXIS, WD) == (
        "srun --nodes=4 --ntasks=32 --ntasks-per-node=8 --cpus-per-task=8 --kill-on-bad-exit=1 "
        "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3' "
        "--container-mounts=/lustre/proj/snakellm:/lustre/proj/snakellm,/lustre/datasets:/lustre/datasets,"
        "/lustre/proj/snakellm/data:/workspace/data:ro "
        "--no-container-mount-home --container-workdir=/lustre/proj/snakellm"
    )


def test_pyxis_needs_srun_so_a_local_run_stays_on_the_host():
    assert launch_prefix({}, PYXIS, WD) == ""
    assert launch_prefix({"tasks": 2}, PYXIS, WD) == "torchrun --standalone --nnodes=1 --nproc-per-node=2 --no-python"


def test_apptainer_inside_srun_one_container_per_rank():
    assert launch_prefix(SLURM_1x2, APPTAINER, WD) == (
        "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=1 "
        "apptainer exec --nv --bind /lustre/proj/snakellm:/lustre/proj/snakellm,"
        "/scratch/hf-cache:/root/.cache/huggingface --pwd /lustre/proj/snakellm /images/snakellm.sif"
    )


def test_apptainer_locally_wraps_torchrun():
    assert launch_prefix({"tasks": 2}, APPTAINER, WD) == (
        "apptainer exec --nv --bind /lustre/proj/snakellm:/lustre/proj/snakellm,"
        "/scratch/hf-cache:/root/.cache/huggingface --pwd /lustre/proj/snakellm /images/snakellm.sif "
        "torchrun --standalone --nnodes=1 --nproc-per-node=2 --no-python"
    )
    assert launch_prefix({}, APPTAINER, WD).endswith("/images/snakellm.sif")


def test_mpirun_launcher():
    res = {"mpi": "mpirun", "nodes": 2, "tasks": 8}
    assert launch_prefix(res, None, WD) == "mpirun -n 8 --npernode 4"


def test_mounts_are_absolute_and_the_workdir_comes_first():
    assert resolve_mounts(["data", "../shared:/shared", "/x:/y:ro", "/lustre/proj/snakellm"], WD) == [
        (WD, WD, ""),
        (f"{WD}/data", f"{WD}/data", ""),
        ("/lustre/proj/shared", "/shared", ""),
        ("/x", "/y", "ro"),
    ]


def test_paths_with_spaces_are_quoted():
    c = {"runtime": "apptainer", "image": "/my images/a.sif"}
    words = shlex.split(launch_prefix({}, c, "/home/me/my proj"))
    assert words == [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        "/home/me/my proj:/home/me/my proj",
        "--pwd",
        "/home/me/my proj",
        "/my images/a.sif",
    ]


@pytest.mark.parametrize(
    "res, msg",
    [
        ({"mpi": "srun", "nodes": 2, "tasks": 3}, "divide evenly"),
        ({"mpi": "srun", "nodes": 2, "tasks": "many"}, "not an integer"),
        ({"mpi": "srun", "nodes": 2, "tasks": 8, "tasks_per_node": 3}, "do not fit"),
    ],
)
def test_impossible_geometry_is_an_error(res, msg):
    with pytest.raises(LaunchConfigError, match=msg):
        launch_args(res, None, WD)


@pytest.mark.parametrize(
    "block, msg",
    [
        ({"runtime": "docker", "image": "x"}, "not one of"),
        ({"runtime": "pyxis"}, "image: required"),
        ({"runtime": "apptainer", "image": "a.sif", "mounts": [":/x"]}, "SRC"),
    ],
)
def test_bad_container_block_is_an_error(block, msg):
    with pytest.raises(LaunchConfigError, match=msg):
        launch_args({"mpi": "srun", "tasks": 2}, block, WD)


def test_geometry_defaults():
    assert geometry({}) == (1, 1, 1, None)
    assert geometry({"nodes": 3}) == (3, 3, 1, None)
    assert geometry({"tasks": 2, "cpus_per_task": -1}) == (1, 2, 2, None)  # -1: the plugin's "no CPU flag"
    assert Container.from_config(None) == Container()


def test_cli_prints_the_full_command(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("container:\n  runtime: pyxis\n  image: /images/x.sqsh\n")
    out = subprocess.run(
        [
            str(BIN / "snakellm"),
            "launch",
            "--configfile",
            str(cfg),
            "-r",
            "mpi=srun",
            "-r",
            "nodes=1",
            "-r",
            "tasks=2",
            "--",
            "snakellm",
            "train",
            "--steps",
            "10",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == (
        "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --kill-on-bad-exit=1 --container-image=/images/x.sqsh "
        f"--container-mounts={tmp_path}:{tmp_path} --no-container-mount-home --container-workdir={tmp_path} "
        "snakellm train --steps 10"
    )


@pytest.mark.slow  # a snakellm process importing megatron-core: ~5 s, end to end (fast-tier budget)
def test_a_cpu_job_runs_on_a_machine_with_a_gpu(tmp_path):
    """`snakellm random-hf` (a CPU job) where torch sees a GPU, as on the device machines: megatron-core gets the
    CPU's RNG tracker, not the CUDA one (whose seeding, with megatron pointed at the CPU, failed there)."""
    import sys

    from conftest import REPO

    code = (
        "import sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1\n"
        "from snakellm.cli import main; sys.exit(main())"
    )
    args = [str(tmp_path / "hf"), "--preset", "tiny-llama", "--seed", "0"]
    args += ["--tokenizer-dir", str(REPO / "resources" / "tokenizers" / "gpt2")]
    proc = subprocess.run(
        [sys.executable, "-c", code, "random-hf", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").exists()
