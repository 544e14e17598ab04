#!/usr/bin/env python3
"""A workflow's jobs from its own dry run, replayed where Snakemake is not installed (GPU machines).

    python scripts/dry_run_jobs.py record DRYRUN.txt JOBS.json   # parse `snakemake -n -p` output
    python scripts/dry_run_jobs.py run JOBS.json --workdir W      # run the jobs in dependency order

``record`` keeps, for each job of the dry run, its rule, output and log paths and the exact shell
command the rule wrote (nothing is re-spelled here: the commands are the workflow's), ordered so that
a job comes after the jobs that make its inputs. ``run`` makes the outputs' and logs' directories (as
Snakemake does), runs the commands in the working directory, one after another except the rules named
by ``--background`` (conversions: they start and the next job goes on, as Snakemake runs them beside the
GPU jobs; a job that needs one of their outputs waits for it), and prints the timestamped
``rule NAME:`` / ``jobid: N`` / ``Finished jobid: N`` lines Snakemake prints, so
scripts/gpu_8b_chain.sh reads either log the same way; the first failing job stops the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def parse(text: str) -> list[dict]:
    """The jobs of a `snakemake -n -p` output (rule, jobid, input, output, log, shell), in dependency order."""
    jobs: list[dict] = []
    cur: dict | None = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("rule ", "localrule ")) and s.endswith(":"):
            cur = {"rule": s.split()[1][:-1], "input": [], "output": [], "log": [], "shell": None}
            jobs.append(cur)
        elif cur is not None and ":" in s and s.split(":", 1)[0] in ("input", "output", "log", "jobid"):
            key, value = s.split(":", 1)
            if key == "jobid":
                cur["jobid"] = int(value)
            else:
                cur[key] = [v.strip() for v in value.split(",") if v.strip()]
        elif cur is not None and s.startswith("Shell command:"):
            cmd = s.split(":", 1)[1].strip()
            cur["shell"] = None if cmd == "None" else cmd
    made = {o: j["jobid"] for j in jobs for o in j["output"]}
    order: list[dict] = []
    done: set[int] = set()

    def visit(j: dict, seen: tuple[int, ...] = ()) -> None:
        if j["jobid"] in done:
            return
        if j["jobid"] in seen:
            raise SystemExit(f"dependency cycle at job {j['jobid']} ({j['rule']})")
        for i in j["input"]:
            if i in made:
                visit(next(x for x in jobs if x["jobid"] == made[i]), (*seen, j["jobid"]))
        done.add(j["jobid"])
        order.append(j)

    for j in jobs:
        visit(j)
    return order


def run(jobs: list[dict], workdir: Path, background: tuple[str, ...] = ()) -> int:
    def say(text: str) -> None:
        print(f"\n[{time.strftime('%a %b %d %H:%M:%S %Y')}]\n{text}", flush=True)

    running: dict[int, tuple[dict, subprocess.Popen]] = {}

    def wait(jobid: int) -> int:
        j, proc = running.pop(jobid)
        rc = proc.wait()
        if rc != 0:
            say(f"Error in rule {j['rule']} (jobid {jobid}): exit {rc}; log: {', '.join(j['log'])}")
        else:
            say(f"Finished jobid: {jobid} (Rule: {j['rule']})")
        return rc

    for j in jobs:
        if not j["shell"]:
            continue
        for jobid in [i for i, (b, _) in running.items() if set(b["output"]) & set(j["input"])]:
            if wait(jobid):
                return 1
        for p in j["output"] + j["log"]:
            (workdir / p).parent.mkdir(parents=True, exist_ok=True)
        say(f"rule {j['rule']}:\n    jobid: {j['jobid']}\n    shell: {j['shell']}")
        proc = subprocess.Popen(j["shell"], shell=True, cwd=workdir, executable="/bin/bash")
        running[j["jobid"]] = (j, proc)
        if j["rule"] not in background and wait(j["jobid"]):
            return 1
    return 1 if any([wait(i) for i in list(running)]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record", help="parse a `snakemake -n -p` output into a job list")
    r.add_argument("dry_run")
    r.add_argument("out")
    x = sub.add_parser("run", help="run a recorded job list in dependency order")
    x.add_argument("jobs")
    x.add_argument("--workdir", required=True)
    x.add_argument("--background", default="", help="comma list of rules whose jobs run beside the next ones")
    a = p.parse_args(argv)
    if a.what == "record":
        jobs = parse(Path(a.dry_run).read_text())
        Path(a.out).write_text(json.dumps(jobs, indent=1) + "\n")
        print(f"{len(jobs)} jobs: {', '.join(j['rule'] for j in jobs)}")
        return 0
    bg = tuple(r for r in a.background.split(",") if r)
    return run(json.loads(Path(a.jobs).read_text()), Path(a.workdir), bg)


if __name__ == "__main__":
    sys.exit(main())
