#!/usr/bin/env bash
# Build (once) the virtual environments of the peer packages the tests check opentau against, each in its own venv
# because their pins clash with ours (openpi-client needs numpy<2):
#   ${OPENTAU_PEERS_DIR:-$HOME/.cache/opentau/peers}/<name>-<version>
# An environment that is already complete (its .complete marker exists) is reused as it is; a half-built one is
# rebuilt. Usage: scripts/peer_envs.sh [NAME ...]   (default: every peer below)
# lerobot-openpi (LeRobot's env + openpi's transformers_replace files) is built from openpi's source (GitHub only: no
# package registry has it): OPENPI_SRC, by default the pinned copy beside the checkout (../shared/peers/openpi-<commit>),
# as lerobot-<version>-openpi-<openpi commit>. lerobot-sim (a copy of lerobot-openpi plus the simulators LeRobot's env
# wrappers import) is built as lerobot-sim-<version>-openpi-<openpi commit>.
set -euo pipefail
PEERS_DIR="${OPENTAU_PEERS_DIR:-$HOME/.cache/opentau/peers}"
PY="${PYTHON:-python3}"
# openpi's source, for the lerobot-openpi env: a checkout named by OPENPI_SRC, else the pinned copy beside the checkout
# (tests/peer_envs.py picks the same default).
PINNED_OPENPI="$(cd "$(dirname "$0")/.." && pwd)/../shared/peers/openpi-15a9616"
if [ -z "${OPENPI_SRC:-}" ] && [ -d "$PINNED_OPENPI" ]; then OPENPI_SRC="$(cd "$PINNED_OPENPI" && pwd)"; fi
OPENPI_CLIENT_VERSION=0.1.2
LEROBOT_VERSION=0.4.4

build() {  # build NAME VERSION PIP_ARGS...
  local name="$1" version="$2"
  shift 2
  local dir="$PEERS_DIR/$name-$version"
  if [ -f "$dir/.complete" ]; then
    echo "peer env $dir: ready"
    return
  fi
  echo "peer env $dir: building"
  rm -rf "$dir"
  mkdir -p "$PEERS_DIR"
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
  if [ "$name" = lerobot ]; then finish_lerobot "$dir"; fi
  touch "$dir/.complete"
}

finish_lerobot() {  # LeRobot itself without its dependency pins (torch < 2.11), and a torchvision stand-in
  local dir="$1"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "lerobot==$LEROBOT_VERSION"
  # LeRobot's import chain imports torchvision, which has no build for this CPU torch; the processors and configs
  # never call it. The stand-in answers any name with an inert class; it sits on sys.path through a .pth file.
  mkdir -p "$dir/stubs/torchvision"
  cat > "$dir/stubs/torchvision/__init__.py" <<'PY'
"""Stand-in for torchvision (none is built for this torch); LeRobot imports it but the code used here never calls it."""
import sys
import types

__version__ = "0.0.0"
for _name in ("transforms", "transforms.v2", "transforms.functional", "transforms.v2.functional", "io", "ops",
              "models", "datasets", "utils"):
    _module = types.ModuleType(f"torchvision.{_name}")
    _module.__getattr__ = lambda attr: type(attr, (), {"__init__": lambda self, *a, **k: None})
    sys.modules[f"torchvision.{_name}"] = _module
PY
  local site
  site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$dir/stubs" > "$site/opentau_stubs.pth"
}

copy_env() {  # copy_env FROM DIR: a copy of the venv FROM, not yet complete, its stand-ins path naming its own copy
  # (its scripts' shebangs still name FROM: run pip as "$DIR/bin/python" -m pip); sets `site` to its site-packages.
  rm -rf "$2"
  cp -a "$1" "$2"
  rm -f "$2/.complete"
  site="$("$2/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$2/stubs" > "$site/opentau_stubs.pth.new" && mv "$site/opentau_stubs.pth.new" "$site/opentau_stubs.pth"
}

openpi_commit() {  # the openpi version a peer env is named after: the checkout's commit, the commit a pinned copy is
  # named after (openpi-<commit>), else a hash of its transformers_replace files
  local base replace="$OPENPI_SRC/src/openpi/models_pytorch/transformers_replace"
  base="$(basename "$OPENPI_SRC")"
  if [ -e "$OPENPI_SRC/.git" ]; then git -C "$OPENPI_SRC" rev-parse --short=7 HEAD
  elif [[ "$base" =~ ^openpi-([0-9a-f]{7,40})$ ]]; then echo "${BASH_REMATCH[1]:0:7}"
  else echo "src-$(cd "$replace" && find . -type f -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-7)"
  fi
}

want() {  # is NAME asked for (no names = all)?
  [ "${#NAMES[@]}" -eq 0 ] && return 0
  local n
  for n in "${NAMES[@]}"; do [ "$n" = "$1" ] && return 0; done
  return 1
}

NAMES=("$@")
# The robot-side client of openpi's websocket policy server, as a robot's process installs it (0.1.2 imports
# typing_extensions without declaring it).
if want openpi-client; then
  build openpi-client "$OPENPI_CLIENT_VERSION" "openpi-client==$OPENPI_CLIENT_VERSION" typing_extensions
fi
# LeRobot's pi05 config and processors (Python 3.11: its newest release for it), beside our torch and the
# transformers its pi05 was written for; its runtime dependencies pinned by hand (its own pins exclude torch 2.13).
# LeRobot's pi05 *model* also needs openpi's transformers_replace files, which only openpi's GitHub source holds.
if want lerobot; then
  build lerobot "$LEROBOT_VERSION" torch==2.13.0 transformers==4.53.2 draccus==0.10.0 datasets==4.8.5 diffusers==0.35.2 \
    "huggingface-hub>=0.34.2,<0.36" accelerate==1.15.0 einops==0.8.2 jsonlines==4.0.0 packaging==25.0 deepdiff==8.6.2 \
    termcolor==3.3.0 gymnasium==1.4.0 safetensors==0.8.0 imageio==2.38.2 av==15.1.0 pyserial==3.5 pynput==1.8.2 \
    "opencv-python-headless>=4.9,<4.13" "rerun-sdk>=0.24,<0.27" "setuptools>=71,<81"
fi
# LeRobot's and openpi's pi05 *models*: a copy of the LeRobot env with openpi's transformers_replace files copied over
# its transformers, as openpi's README tells its users to do (LeRobot's pi05 checks for them). The lerobot env itself
# is left as it is (a copy, never the same files).
if want lerobot-openpi; then
  if [ -z "${OPENPI_SRC:-}" ]; then
    echo "peer env lerobot-openpi: not built: OPENPI_SRC is not set and $PINNED_OPENPI is missing (openpi's source, which its transformers_replace files come from, is on GitHub only)" >&2
    if [ -n "${CI:-}" ]; then exit 1; fi
  else
    "$(dirname "$0")/peer_envs.sh" lerobot
    replace="$OPENPI_SRC/src/openpi/models_pytorch/transformers_replace"
    [ -d "$replace" ] || { echo "OPENPI_SRC=$OPENPI_SRC: no $replace (not a checkout of openpi's source)" >&2; exit 2; }
    dir="$PEERS_DIR/lerobot-$LEROBOT_VERSION-openpi-$(openpi_commit)"
    if [ -f "$dir/.complete" ]; then
      echo "peer env $dir: ready"
    else
      echo "peer env $dir: building (a copy of lerobot-$LEROBOT_VERSION + $replace)"
      copy_env "$PEERS_DIR/lerobot-$LEROBOT_VERSION" "$dir"
      cp -r "$replace"/. "$site/transformers/"
      # openpi's normalization (openpi.shared.normalize) reads norm_stats.json through pydantic + numpydantic, at
      # the versions of openpi's uv.lock.
      "$dir/bin/python" -m pip install --quiet --disable-pip-version-check numpydantic==1.6.9 pydantic==2.11.5
      "$dir/bin/python" -c 'from transformers.models.siglip import check; assert check.check_whether_transformers_replace_is_installed_correctly()'
      touch "$dir/.complete"
    fi
  fi
fi
# LeRobot's env wrappers and eval pipeline with its pi05 (tests/test_eval_peer.py, benchmarks/bench_eval.py): a copy of
# the lerobot-openpi env plus the simulators `lerobot.envs` imports, at the versions that install together (MetaWorld
# pins mujoco 3.3.0 and imports only with `packaging` beside it; gym-aloha takes dm_control 1.0.28 with that mujoco).
# The lerobot-openpi env itself is left as it is.
if want lerobot-sim; then
  if [ -z "${OPENPI_SRC:-}" ]; then
    echo "peer env lerobot-sim: not built: OPENPI_SRC is not set and $PINNED_OPENPI is missing (openpi's source, which its transformers_replace files come from, is on GitHub only)" >&2
    if [ -n "${CI:-}" ]; then exit 1; fi
  else
    "$(dirname "$0")/peer_envs.sh" lerobot-openpi
    commit="$(openpi_commit)"
    from="$PEERS_DIR/lerobot-$LEROBOT_VERSION-openpi-$commit"
    dir="$PEERS_DIR/lerobot-sim-$LEROBOT_VERSION-openpi-$commit"
    if [ -f "$dir/.complete" ]; then
      echo "peer env $dir: ready"
    else
      echo "peer env $dir: building (a copy of $from + the simulators)"
      copy_env "$from" "$dir"
      "$dir/bin/python" -m pip install --quiet --disable-pip-version-check metaworld==3.1.1 mujoco==3.3.0 packaging==25.0 \
        gym-pusht==0.1.8 gym-aloha==0.1.5 dm-control==1.0.28
      "$dir/bin/python" -c "import metaworld, gym_pusht, gym_aloha"
      touch "$dir/.complete"
    fi
  fi
fi
