#!/usr/bin/env bash
# Installs what the test cluster (tests/cluster/netns.py) needs. Idempotent: when every
# package is already installed it only runs dpkg-query (well under a second).
set -euo pipefail

# Debian packages, see docs/cluster-testing.md.
PKGS=(docker.io containerd runc openssh-server openssh-client iproute2 util-linux procps debootstrap)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python packages the remote layer uses (also in setup.cfg install_requires).
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import paramiko, docker' 2>/dev/null; then
  echo "install_deps: installing paramiko and docker for $PY"
  "$PY" -m pip install -q "paramiko>=3.4" "docker>=7"
fi
