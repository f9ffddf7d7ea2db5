#!/usr/bin/env bash
# The simulators of `opentau eval --env` and `opentau dataset synth --env`: the system GL libraries MuJoCo renders
# with on a CPU (MUJOCO_GL=egl, Mesa's llvmpipe), installed only where missing, and the [sim] extra into .venv.
# Safe to re-run. Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
GL_PACKAGES="libegl1 libegl-mesa0 libgbm1 libgl1-mesa-dri"
missing=""
for pkg in $GL_PACKAGES; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup_sim.sh: missing GL libraries ($missing ) and no apt-get: install them with your system's package manager." >&2
    exit 2
  fi
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
# Nothing to install when every requirement of the [sim] extra is met already (scripts/test.sh has setup.sh build it
# into the cached environment): pip would still rebuild the editable install.
if ! .venv/bin/python - <<'PY'
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

for requirement in map(Requirement, metadata.requires("opentau-cli") or []):
    if requirement.marker is None or not requirement.marker.evaluate({"extra": "sim"}):
        continue
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if not requirement.specifier.contains(installed, prereleases=True):
        sys.exit(1)
PY
then
  .venv/bin/python -m pip install --quiet -e '.[sim]'
fi
