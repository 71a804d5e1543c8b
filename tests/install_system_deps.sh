#!/usr/bin/env bash
# System packages the whole test suite needs, in one apt transaction. Idempotent: when every
# package is installed it only runs dpkg-query (well under a second). Needs root.
#   namespace cluster (tests/cluster/): docker.io containerd runc openssh-server openssh-client
#                                       iproute2 util-linux procps debootstrap
#   Slurm cluster (tests/slurm/):       slurm-wlm munge
#   report page test:                   chromium fonts-dejavu-core
set -euo pipefail

PKGS=(docker.io containerd runc openssh-server openssh-client iproute2 util-linux procps debootstrap
      slurm-wlm munge chromium fonts-dejavu-core)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_system_deps.sh: missing ${missing[*]}; installing them needs root" >&2
  exit 1
fi
echo "install_system_deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# the packages may enable their services; the tests start their own daemons by hand
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  for svc in slurmctld slurmd munge docker containerd ssh; do
    systemctl disable --now "$svc" >/dev/null 2>&1 || true
  done
fi
