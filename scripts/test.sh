#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Prints what explains a slow run: the set-up time, the machine's
# load before and after (a busy machine stretches every launch), the 15 slowest tests and modules, and how busy the
# cores were while the tests ran, and the CPU by kind of process (scripts/cpu_by_process.py).
#   ./scripts/test.sh               the whole suite (what CI runs); extra arguments go to pytest
#   ./scripts/test.sh --quick       the quick tier: the modules marked `quick` (each package's contracts on the tiny
#                                   preset, a few minutes), for the inner loop; the whole suite before a merge
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m "quick and not full")  # a quick module's test may keep itself to the whole suite by its own `full` mark
fi
echo "load before: $(cat /proc/loadavg 2>/dev/null || uptime) on $(nproc) cores"
setup_start=$SECONDS
# .venv from the dependency environment cached by version (~/.cache/opentau/venvs), DeepSpeed's CPU op compiled in
OPENTAU_PREBUILD_DEEPSPEED_OP=1 ./scripts/setup.sh dev sim
./scripts/setup_sim.sh    # the simulators of `opentau eval --env` (the [sim] extra) and the GL libraries they render with
./scripts/setup_slurm.sh  # Debian's SLURM and munge: tests/slurm_cluster.py starts a real cluster
export OPENTAU_CACHE_DIR="${OPENTAU_CACHE_DIR:-$PWD/.cache/opentau}"
# Two test workers share the cores, and a process whose torch computes on more than one thread (a single-process
# launch, an evaluation, an in-process test) would otherwise spin in OpenMP's barriers waiting for threads the other
# worker's processes hold: two concurrent single-process trainings take about a quarter of the CPU with PASSIVE
# (benchmarks/bench_omp_wait.py, docs/development.md). It changes no result.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
./scripts/peer_envs.sh  # the peers' own packages the tests check against (built once, cached)
# opentau's own modules compiled once here, not in every process a test starts: where PYTHONDONTWRITEBYTECODE is set
# (as on CI's machines) Python would compile them again in each (a few tenths of a second of CPU per launch).
.venv/bin/python -m compileall -q src
# DeepSpeed's CPU communication op, loaded here before any test runs: scripts/setup.sh compiles it into the cached
# environment's DeepSpeed, so this only checks it loads. Where that prebuild failed it is built here once per checkout:
# a test that kills a rank while that rank builds it would leave torch's build lock behind, and every later DeepSpeed
# launch would wait on it; a folder per checkout also keeps other checkouts' builds from taking turns with ours.
mkdir -p .cache
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
.venv/bin/python -c "from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
builder and builder.load(verbose=False)" > .cache/deepspeed_op_build.log 2>&1 || { cat .cache/deepspeed_op_build.log; exit 1; }
echo "set-up: $((SECONDS - setup_start)) s"
tests_start=$SECONDS
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $6, $5}' /proc/stat 2>/dev/null; }  # busy, disk wait, idle
read -r busy0 wait0 idle0 <<< "$(cpu_ticks)" || true
status=0
.venv/bin/python scripts/cpu_by_process.py & cpu_watch=$!
# Two workers (pytest-xdist), each taking whole modules so a module's shared runs are made once, in the order
# tests/conftest.py gives (slow modules first): a 2-process launch leaves a core idle while it plans, starts and
# saves, and a single-process test uses one core of two. TEST_WORKERS=0 runs in this process. (Three workers on
# two cores measured slower, 1315 s against 1108 s: the cores are then never idle but every launch waits longer.)
# A passing test's tmp_path is removed as it ends, a failing one's kept to read (pytest's retention policy "failed"):
# the whole suite's checkpoints would otherwise stay on a disk that other jobs may be filling too.
.venv/bin/python -m pytest -q -o tmp_path_retention_policy=failed --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder ${tier[@]+"${tier[@]}"} "$@" || status=$?
echo "tests: $((SECONDS - tests_start)) s"
kill -TERM "$cpu_watch" 2>/dev/null && wait "$cpu_watch" || true
echo "load after: $(cat /proc/loadavg 2>/dev/null || uptime)"
# Where the cores' time went while the tests ran: CI's minutes are CPU seconds where busy is near 100%; an idle or
# disk-wait share is time a worker waited (a sleep, a timeout, fsync) that another worker could have used.
read -r busy1 wait1 idle1 <<< "$(cpu_ticks)" || true
if [ -n "${busy0:-}" ] && [ -n "${busy1:-}" ]; then
  all=$(( (busy1 - busy0) + (wait1 - wait0) + (idle1 - idle0) ))
  [ "$all" -gt 0 ] && echo "cores during the tests: busy $(( 100 * (busy1 - busy0) / all ))%, waiting on disk $(( 100 * (wait1 - wait0) / all ))%, idle $(( 100 * (idle1 - idle0) / all ))%"
fi
exit $status
