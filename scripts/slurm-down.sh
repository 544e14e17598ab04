#!/usr/bin/env bash
# slurm-down.sh - stop the test cluster that scripts/slurm-up.sh started.
#
# Stops only daemons recorded in slurm-up.sh's pid files under $SNAKELLM_SLURM_DIR, and only
# when the pid still is that daemon; anything else (a munged or mariadbd this script did not
# start, another Slurm) is left alone. Packages, config and state are kept, so the next
# slurm-up.sh takes seconds.
#   --purge   also delete $SNAKELLM_SLURM_DIR (job state, accounting database, logs)
set -uo pipefail
BASE=${SNAKELLM_SLURM_DIR:-/tmp/snakellm-slurm}
PURGE=0
case "${1:-}" in
  --purge) PURGE=1 ;;
  "") ;;
  *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac

alive() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
# stop NAME PIDFILE COMM
stop() {
  local name=$1 pf=$2 comm=$3 pid
  [ -s "$pf" ] || { echo "$name: not started by slurm-up.sh (no $pf)"; return 0; }
  pid=$(cat "$pf")
  if ! alive "$pid" || [ "$(cat /proc/"$pid"/comm 2>/dev/null)" != "$comm" ]; then
    echo "$name: pid $pid not running (stale pid file removed)"; rm -f "$pf"; return 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.2; done
  if alive "$pid"; then echo "$name: pid $pid ignored SIGTERM for 20 s, sending SIGKILL"; kill -KILL "$pid"; fi
  rm -f "$pf"
  echo "$name: stopped (pid $pid)"
}

# cancel this cluster's jobs first, so their slurmstepd's do not outlive slurmd
if [ -s "$BASE/run/slurmctld.pid" ] && alive "$(cat "$BASE/run/slurmctld.pid")"; then
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    echo "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs
    for _ in $(seq 1 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
stop slurmd    "$BASE/run/slurmd.pid"    slurmd
stop slurmctld "$BASE/run/slurmctld.pid" slurmctld
stop slurmdbd  "$BASE/run/slurmdbd.pid"  slurmdbd
stop mariadbd  "$BASE/db/run/mysqld.pid" mariadbd
stop munged    "$BASE/munge/munged.pid"  munged
if [ "$PURGE" = 1 ]; then rm -rf "$BASE"; echo "removed $BASE"; fi
