"""Rank mapping from torchrun / srun / OpenMPI, Slurm hostlists, and a real world-size-2 run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv

from snakellm.launch.distributed import LaunchError, detect, expand_hostlist

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu7", ["gpu7"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("dgx-[8-10]-ib", ["dgx-8-ib", "dgx-9-ib", "dgx-10-ib"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_bad_hostlists_are_errors():
    for bad in ("node[3-1]", "node[a-b]", "node[01"):
        with pytest.raises(LaunchError):
            expand_hostlist(bad)


def test_torchrun():
    d = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29501",
        }
    )
    assert (d.launcher, d.rank, d.world_size, d.local_rank, d.local_world_size) == ("torchrun", 3, 8, 1, 4)
    assert (d.master_addr, d.master_port) == ("10.0.0.1", 29501)


def test_srun_takes_master_addr_from_the_first_node():
    d = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "4",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (d.launcher, d.rank, d.world_size, d.local_rank, d.local_world_size) == ("srun", 5, 8, 1, 4)
    assert d.master_addr == "gpu07" and d.master_port == 20000 + 4242
    # a step retried inside the job, or the requeued job, rendezvous on another port than the last attempt
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu07"}
    ports = {
        detect({**base, "SLURM_JOB_ID": "4242", **extra}).master_port
        for extra in ({}, {"SLURM_STEP_ID": "1"}, {"SLURM_STEP_ID": "2"}, {"SLURM_RESTART_COUNT": "1"})
    }
    assert len(ports) == 4 and all(20000 <= p < 40000 for p in ports), ports
    # tasks per node in Slurm's compressed form
    d = detect(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_ID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_STEP_NODELIST": "n[1-2]",
        }
    )
    assert d.local_world_size == 4 and d.master_addr == "n1"


def test_a_batch_script_is_one_process_not_a_slurm_step():
    # sbatch sets SLURM_PROCID/SLURM_NTASKS for the batch script itself; only srun makes a step
    d = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[1-2]"})
    assert (d.launcher, d.world_size) == ("single", 1)
    assert d.master_addr == "node1"


def test_openmpi():
    d = detect(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "head",
        }
    )
    assert (d.launcher, d.rank, d.world_size, d.local_rank, d.local_world_size) == ("mpirun", 2, 4, 0, 2)


def test_torchrun_wins_over_slurm_and_explicit_master_addr_wins():
    d = detect(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "x[1-2]",
            "MASTER_ADDR": "y",
        }
    )
    assert (d.launcher, d.rank, d.master_addr) == ("torchrun", 1, "y")


def test_single_process_and_impossible_ranks():
    assert detect({}).launcher == "single" and detect({}).world_size == 1
    with pytest.raises(LaunchError, match="rank 4 is outside world size 4"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="not an integer"):
        detect({"RANK": "a", "WORLD_SIZE": "4"})


@pytest.mark.slow
def test_world_size_2_on_cpu_trains_identical_replicas(tmp_path):
    """torchrun, 2 ranks, gloo: data parallel with the same losses as 1 rank with 2 accumulation steps."""
    from test_train import BASE, make_blend

    make_blend(tmp_path)
    common = ["train", "--blend", "data/tokens/synth/blend.json", *BASE, "--steps", "8", "--save-interval", "4"]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python", str(BIN / "snakellm")]
    env = env_with_venv()
    proc = subprocess.run(
        [*torchrun, *common, "--run-dir", "runs/dp2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world 2 (torchrun) = dp 2 x tp 1 x pp 1; global batch 8 = micro 4 x dp 2 x 1 accumulation" in proc.stderr
    s = json.loads((tmp_path / "runs/dp2/train_summary.json").read_text())
    assert s["world_size"] == 2
    digests = s["replica_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # sha256 of every weight, gathered from both ranks
    # the same global batch on one rank (2 accumulation steps): the same trajectory up to float rounding
    proc = subprocess.run(
        [str(BIN / "snakellm"), *common, "--run-dir", "runs/dp1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = (
        [json.loads(ln) for ln in (tmp_path / f"runs/{r}/metrics.jsonl").read_text().splitlines()]
        for r in ("dp1", "dp2")
    )
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(a["loss"])
    # a data-parallel checkpoint resumes on another world size (the sample order is global): extend the
    # 2-rank run by 2 steps on 1 rank (the same schedule: decay_steps stays 8)
    longer = [*common[:-4], "--steps", "10", "--decay-steps", "8", "--save-interval", "4"]
    proc = subprocess.run(
        [str(BIN / "snakellm"), *longer, "--run-dir", "runs/dp2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from runs/dp2/checkpoints/iter_0000008" in proc.stderr
