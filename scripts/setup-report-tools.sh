#!/usr/bin/env bash
# setup-report-tools.sh - Graphviz (`dot`, for DAG pictures) and Chromium (the report test's
# headless browser), from Debian packages where missing.
#
# Idempotent: when `dot` and `chromium` are already on PATH it only checks and exits (a few
# milliseconds). Installing needs root and apt-get; without them it says what is missing and
# exits 1 (the tests that need these tools then skip with that reason). Called by
# scripts/test.sh; run it by hand before `snakellm dag` or the report test on a new machine.
#
# Environment: SNAKELLM_REPORT_TOOLS_SKIP=1 does nothing (for machines that must not apt).
set -euo pipefail
[ "${SNAKELLM_REPORT_TOOLS_SKIP:-0}" = 1 ] && exit 0

have() { command -v "$1" >/dev/null 2>&1; }
missing=""
have dot || missing="$missing graphviz"
have chromium || have chromium-browser || missing="$missing chromium"
# matplotlib and the HTML report need a sans-serif font; Debian's chromium pulls fonts-liberation
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ] || ! have apt-get; then
  echo "setup-report-tools: missing:$missing (install them with your package manager; needs root + apt here)" >&2
  exit 1
fi
echo "setup-report-tools: installing:$missing (Debian packages; about a minute)" >&2
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-o DPkg::Lock::Timeout=300 -o Acquire::Retries=3)
log=$(mktemp /tmp/setup-report-tools.XXXXXX.log)
{
  apt-get "${apt_opts[@]}" update -qq &&
  # shellcheck disable=SC2086
  apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends $missing fonts-liberation
} >"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "setup-report-tools: apt-get failed (log: $log)" >&2; exit 1; }
rm -f "$log"
have dot || { echo "setup-report-tools: graphviz installed but no dot on PATH" >&2; exit 1; }
have chromium || have chromium-browser || { echo "setup-report-tools: chromium installed but not on PATH" >&2; exit 1; }
echo "setup-report-tools: done" >&2
