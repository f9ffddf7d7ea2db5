#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Prints what explains a slow run: the set-up time, the machine's
# load before and after (a busy machine stretches every launch), and the 15 slowest tests and modules.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "load before: $(cat /proc/loadavg 2>/dev/null || uptime) on $(nproc) cores"
setup_start=$SECONDS
./scripts/setup.sh
./scripts/setup_sim.sh    # the simulators of `opentau eval --env` (the [sim] extra) and the GL libraries they render with
./scripts/setup_slurm.sh  # Debian's SLURM and munge: tests/slurm_cluster.py starts a real cluster
echo "set-up: $((SECONDS - setup_start)) s"
export OPENTAU_CACHE_DIR="${OPENTAU_CACHE_DIR:-$PWD/.cache/opentau}"
./scripts/peer_envs.sh  # the peers' own packages the tests check against (built once, cached)
tests_start=$SECONDS
status=0
# Two workers (pytest-xdist), each taking whole modules so a module's shared runs are made once, in the order
# tests/conftest.py gives (slow modules first): a 2-process launch leaves a core idle while it plans, starts and
# saves, and a single-process test uses one core of two. TEST_WORKERS=0 runs in this process. (Three workers on
# two cores measured slower, 1315 s against 1108 s: the cores are then never idle but every launch waits longer.)
.venv/bin/python -m pytest -q --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
echo "tests: $((SECONDS - tests_start)) s"
echo "load after: $(cat /proc/loadavg 2>/dev/null || uptime)"
exit $status
