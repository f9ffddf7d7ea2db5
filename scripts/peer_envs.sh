#!/usr/bin/env bash
# Build (once) the virtual environments of the peer packages the tests check opentau against, each in its own venv
# because their pins clash with ours (openpi-client needs numpy<2):
#   ${OPENTAU_PEERS_DIR:-$HOME/.cache/opentau/peers}/<name>-<version>
# An environment that is already complete (its .complete marker exists) is reused as it is; a half-built one is
# rebuilt. Usage: scripts/peer_envs.sh [NAME ...]   (default: every peer below)
set -euo pipefail
PEERS_DIR="${OPENTAU_PEERS_DIR:-$HOME/.cache/opentau/peers}"
PY="${PYTHON:-python3}"
OPENPI_CLIENT_VERSION=0.1.2

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
  touch "$dir/.complete"
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
