#!/usr/bin/env bash
# The README's test command: what the tests need from the system, the package with its test extras,
# then the suite. `.ci/run` calls exactly this (in a brand-new virtualenv).
#
#   scripts/test.sh                 # everything: about 27 minutes on a 2-core machine with DeepSpeed's ops
#                                   # built, 36 on a fresh one, as CI (docs/reliability.md "CI time"; mostly the
#                                   # real launches, one at a time, while the other worker runs the rest)
#   scripts/test.sh -m "not slow"   # no real DeepSpeed launches: about 5 minutes (8 serially)
#   scripts/test.sh -n 0            # one process, serially (also: -p no:xdist)
#
# System packages: libaio-dev (DeepSpeed's NVMe-offload op), slurm-wlm and munge (a real two-node
# Slurm cluster on 127.0.0.1). They are installed with apt when this runs as root (or with
# passwordless sudo); otherwise the script says which are missing and how to get them, and the
# tests that need them are skipped with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for pkg in libaio-dev slurm-wlm munge; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null && need=()
  elif sudo -n true 2>/dev/null; then
    sudo DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null && need=()
  fi
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "scripts/test.sh: missing system packages: ${need[*]}; the NVMe-offload and Slurm tests will be" \
       "skipped. To run them: sudo apt-get install ${need[*]}" >&2
fi

PIP_DISABLE_PIP_VERSION_CHECK=1 python -m pip install -q torch==2.13.0 -e ".[dev]"
# lint and types first (seconds): pyproject.toml's [tool.ruff] and [tool.mypy]
python -m ruff check jobspec
python -m mypy jobspec
# Two pytest-xdist workers (the machine has 2 cores): the real launches run one at a time on one of
# them while the other runs everything else (tests/xdist_schedule.py groups them). `-n 0` or
# `-p no:xdist` among the arguments runs the suite serially in one process.
xdist=(-n 2)
for arg in "$@"; do
  case "$arg" in no:xdist|-pno:xdist) xdist=() ;; esac
done
exec python -m pytest -q ${xdist[@]+"${xdist[@]}"} "$@"
