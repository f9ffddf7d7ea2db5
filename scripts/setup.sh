#!/usr/bin/env bash
# Create .venv and install opentau with its test and video extras. Safe to re-run.
# Usage: scripts/setup.sh [EXTRA ...]   (default: dev; scripts/test.sh asks for dev and sim)
#
# The dependencies are built once per version into a cache and each clone's .venv is made from it in seconds:
#   ${OPENTAU_VENVS_DIR:-$HOME/.cache/opentau/venvs}/<hash of pyproject.toml, TORCH_SPEC, the extras and Python>
# .venv is a copy of that environment (its files hard links where the filesystem allows: Python and pip replace
# files, never write into them) plus this clone's editable install. The cache is never needed: a missing or
# half-built one (no .complete marker, or one whose Python no longer imports torch) is built again, and without
# it this script installs as it always did. A .venv this script did not make from the cache is updated in place
# (pip installs what is missing), never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# The CPU build of torch 2.13 is what these machines install offline; on a GPU machine pip picks the CUDA build
# of the same version from its index (set PIP_INDEX_URL / TORCH_SPEC to choose another).
TORCH="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="$(IFS=,; echo "${*:-dev}")"
PIP=(-m pip install --quiet --disable-pip-version-check)

# OPENTAU_PREBUILD_DEEPSPEED_OP=1 (scripts/test.sh sets it): compile DeepSpeed's CPU communication op into the cached
# environment; an environment with it is cached under a key of its own.
PREBUILD_OP="${OPENTAU_PREBUILD_DEEPSPEED_OP:-0}"
key="$({ cat pyproject.toml; echo "$TORCH"; echo "$EXTRAS"
         if [ "$PREBUILD_OP" = 1 ]; then echo "deepspeed CPU communication op prebuilt"; fi
         "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"
VENVS="${OPENTAU_VENVS_DIR:-$HOME/.cache/opentau/venvs}"
cache="$VENVS/$key"

complete() {  # is the cached environment whole? (its marker, and its Python imports torch)
  [ -f "$cache/.complete" ] && "$cache/bin/python" -c 'import torch' >/dev/null 2>&1
}

build_cache() {  # the dependencies of opentau[EXTRAS] with torch, without opentau itself
  echo "setup: building the dependency environment $cache (once per version of pyproject.toml, torch and Python)"
  rm -rf "$cache" "$cache.tmp"
  mkdir -p "$VENVS"
  "$PY" -m venv "$cache.tmp"
  # Built under its own name, then renamed: a script's first line names the interpreter by path.
  "$cache.tmp/bin/python" "${PIP[@]}" --upgrade pip
  "$cache.tmp/bin/python" "${PIP[@]}" "$TORCH" "setuptools>=68" wheel
  "$cache.tmp/bin/python" "${PIP[@]}" -e ".[$EXTRAS]"
  "$cache.tmp/bin/python" -m pip uninstall --quiet --yes opentau-cli
  if [ "$PREBUILD_OP" = 1 ]; then prebuild_deepspeed_op "$cache.tmp/bin/python"; fi
  mv "$cache.tmp" "$cache"
  retarget "$cache.tmp" "$cache"
  touch "$cache/.complete"
}

prebuild_deepspeed_op() {  # PYTHON: DeepSpeed again, with its CPU communication op compiled into the package
  # On a CPU torch every DeepSpeed launch needs this op (deepspeed_shm_comm); from PyPI DeepSpeed compiles it with the
  # C++ compiler on first use, in every clone (about a minute on 2 cores): the test suite's set-up paid it on every
  # fresh clone. Built here once per cached environment, DeepSpeed imports it instead. Not by default: it costs the
  # first set-up about 2.5 minutes (DeepSpeed built again), and a user's training seldom runs DeepSpeed on a CPU.
  # Where this fails (no compiler) DeepSpeed still builds it on first use.
  local version
  version="$("$1" -c 'import importlib.metadata as m, torch
print(m.version("deepspeed") if torch.version.cuda is None and torch.version.hip is None else "")' 2>/dev/null)" || return 0
  [ -n "$version" ] || return 0  # no DeepSpeed, or a GPU torch (it communicates with NCCL, not this op)
  DS_BUILD_SHM_COMM=1 "$1" "${PIP[@]}" --no-deps --no-build-isolation --force-reinstall --no-cache-dir \
    "deepspeed==$version" || echo "setup: DeepSpeed's CPU communication op was not prebuilt; it is built on first use"
}

retarget() {  # retarget FROM TO: the scripts in TO/bin that name FROM (a script's first line names its interpreter)
  local script
  for script in "$2"/bin/*; do
    [ -f "$script" ] && [ ! -L "$script" ] || continue
    if grep -Iq "$1" "$script"; then  # text files only (-I)
      sed -i "s|$1|$2|g" "$script"  # sed -i writes a new file: the hard link's other name keeps the old one
    fi
  done
}

if [ -f .venv/.dependencies ] && [ "$(cat .venv/.dependencies)" != "$key" ]; then
  echo "setup: pyproject.toml, TORCH_SPEC, the extras or Python changed since .venv was made: making it again"
  rm -rf .venv
fi
if [ ! -e .venv ]; then
  complete || build_cache
  rm -rf .venv.tmp
  cp -al "$cache" .venv.tmp 2>/dev/null || { rm -rf .venv.tmp; cp -a "$cache" .venv.tmp; }  # hard links need one filesystem
  rm -f .venv.tmp/.complete
  retarget "$cache" "$PWD/.venv.tmp"
  mv .venv.tmp .venv
  retarget "$PWD/.venv.tmp" "$PWD/.venv"
  .venv/bin/python "${PIP[@]}" --no-deps --no-build-isolation -e .
  echo "$key" > .venv/.dependencies  # last: a .venv without it is installed into as below
elif [ ! -f .venv/.dependencies ]; then
  # A .venv made before the cache, by hand, or by a run of this script that stopped: installed into as before.
  .venv/bin/python "${PIP[@]}" --upgrade pip
  .venv/bin/python "${PIP[@]}" "$TORCH"
  .venv/bin/python "${PIP[@]}" -e ".[$EXTRAS]"
fi
