#!/usr/bin/env bash
# Sets up this machine for the whole test suite: system packages for the real
# test cluster (sshd, dockerd, network namespaces, Slurm, Chromium), the harness
# itself, and the cpu vendor's framework environments (built once, cached).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then
  bash tests/install_system_deps.sh      # sshd, dockerd, debootstrap, Slurm, munge, Chromium
fi

python3 -m pip install --disable-pip-version-check -q -e ".[test]"

# the cpu vendor's per-framework environments, as the local runtime builds them
for fw in megatron deepspeed paddle; do
  python3 - "$fw" <<'PY'
import sys, time
from pathlib import Path
from run_benchmarks import envs
fw = sys.argv[1]
t = time.monotonic()
log = envs.cache_root() / f"build-{fw}.log"
log.parent.mkdir(parents=True, exist_ok=True)
py = envs.ensure_env("cpu", fw, log)
print(f"{fw} environment: {py} ({time.monotonic() - t:.0f} s)")
PY
done
