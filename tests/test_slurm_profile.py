"""`snakemake -n -p --profile profiles/slurm`: what each GPU stage's job asks Slurm for, from config alone.

Dry runs of the shipped profile (no cluster needed: the plugin submits nothing in a dry run) on the
example configs, with no SNAKELLM_* variable set: the allocation is the config's
(`runs.<name>.resources`, `finetune.<name>.resources`, `resources.<stage>`, snakellm.config.jobs), and a
multi-rank job is launched with the rule's own `srun`. The jobs running on a real cluster are
tests/test_slurm.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from conftest import BIN, REPO, SNAKEFILE

PROFILE = REPO / "profiles" / "slurm"
EXAMPLES = REPO / "config" / "examples"


def dry_run(root, config: dict, *targets: str) -> str:
    """`snakemake -n -p --profile profiles/slurm` in ``root`` with no SNAKELLM_* variable: its output."""
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKELLM_", "SLURM_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(BIN / "snakemake"), "-s", str(SNAKEFILE), "-d", str(root), "--configfile", str(root / "config.yaml")]
    cmd += ["--replace-workflow-config", "--profile", str(PROFILE), "-n", "-p", "--nocolor", *targets]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def job(out: str, rule: str) -> tuple[dict[str, str], str]:
    """The first `rule` job of a dry run: its resources and its shell command."""
    block = out[out.index(f"rule {rule}:") :]
    res = re.search(r"^\s+resources: (.*)$", block, re.M)
    shell = re.search(r"^Shell command: (.*)$", block, re.M)
    assert res and shell, block[:3000]
    return dict(kv.split("=", 1) for kv in res.group(1).split(", ") if "=" in kv), shell.group(1).strip()


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_8b_recipe_asks_for_its_8_nodes_from_its_own_config(tmp_path):
    shutil.copytree(REPO / "resources" / "tokenizers", tmp_path / "resources" / "tokenizers")
    cfg = yaml.safe_load((EXAMPLES / "slimpajama-gpt-8b.yaml").read_text())
    res, shell = job(dry_run(tmp_path, cfg, "runs/gpt-8b/train_summary.json"), "pretrain")
    assert shell.startswith(
        "srun --nodes=8 --ntasks=64 --ntasks-per-node=8 --cpus-per-task=8 --kill-on-bad-exit=1 "
        "--container-image=nvcr.io/nvidia/pytorch:25.04-py3 "
    ), shell
    assert " snakellm train " in shell and "--tp 4" in shell
    # what the plugin turns into `sbatch --nodes=8 --ntasks=64 --gpus=64 --cpus-per-task=8 -t 1440 --signal=USR1@300`
    assert {k: res[k] for k in ("nodes", "tasks", "gpu", "cpus_per_task", "mpi", "runtime", "slurm_extra")} == {
        "nodes": "8",
        "tasks": "64",
        "gpu": "64",
        "cpus_per_task": "8",
        "mpi": "srun",
        "runtime": "1440",
        "slurm_extra": "--signal=USR1@300",
    }


@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_finetune_example_is_a_2_gpu_srun_job_and_its_evaluations_one_gpu_each(tmp_path):
    shutil.copytree(REPO / "resources", tmp_path / "resources")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(yaml.safe_load((EXAMPLES / "tiny-squad-finetune.yaml").read_text()))
    out = dry_run(tmp_path, cfg, "runs/tiny/eval/tiny-lora/tuned/metrics.json")
    res, shell = job(out, "finetune")
    assert shell.startswith("srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=2 --kill-on-bad-exit=1 ")
    assert " snakellm finetune --base runs/tiny " in shell
    assert (res["gpu"], res["tasks"], res["mpi"], res["runtime"]) == ("2", "2", "srun", "240")
    res, shell = job(out, "evaluate_finetune")
    assert (res["gpu"], res["tasks"], res["nodes"]) == ("1", "1", "1") and "mpi" not in res
    assert shell.startswith("snakellm evaluate ")  # one rank: a plain job, no srun of its own
    res, shell = job(out, "pretrain")  # the run nobody sized: one GPU, the built-in default
    assert (res["gpu"], res["tasks"], res["mem_mb"]) == ("1", "1", "0") and shell.startswith("snakellm train ")
