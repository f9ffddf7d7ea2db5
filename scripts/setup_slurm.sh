#!/usr/bin/env bash
# Install what tests/slurm_cluster.py starts: SLURM's controller, node daemon and clients, and munge (Debian's
# packages; nothing is started or configured here, the tests start their own cluster). Safe to re-run: installs only
# what is missing. Needs root (apt-get).
set -euo pipefail
missing=()
for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
