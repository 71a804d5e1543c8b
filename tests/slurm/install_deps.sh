#!/usr/bin/env bash
# Installs what the real Slurm test cluster needs (tests/slurm/cluster.py): Slurm's
# controller, node daemon and client commands, and munge.  Idempotent: does nothing
# when the programs are already there.  Needs root (apt).
set -euo pipefail

need=()
for prog in slurmctld slurmd sbatch srun squeue scontrol scancel munged mungekey; do
  command -v "$prog" >/dev/null 2>&1 || need+=("$prog")
done
if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_deps.sh: missing ${need[*]}; run as root to install slurm-wlm and munge" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
# the packages enable their services; the test cluster starts its own daemons by hand
for svc in slurmctld slurmd munge; do
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now "$svc" >/dev/null 2>&1 || true
  fi
done
