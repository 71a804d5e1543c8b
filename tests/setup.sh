#!/usr/bin/env bash
# Sets up this machine for the whole test suite: system packages for the real
# test cluster (sshd, dockerd, network namespaces, Slurm, Chromium), the harness
# itself, the cpu vendor's framework environments (built once, cached), DeepSpeed's
# CPU comm op and the test cluster's base image (both built once, cached).
#
# On a fresh machine the slow parts are pip, debootstrap and one C++ build, mostly
# waiting on downloads and disks: they run side by side. The three environments build
# at once (each under its own lock, pip's output in build-<framework>.log of the
# environments' cache), DeepSpeed's comm op as soon as its environment is there, the
# base image once the system packages (debootstrap) are in. With the base image cached and
# the rest not (2 cores, 2026-11-27): 135 s, where one environment after another took 258 s
# and the comm op 32 s more in the suite's first DeepSpeed run.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs_=()   # "what pid" of each background step
trap 'for j in "${jobs_[@]}"; do kill "${j##* }" 2>/dev/null || true; done' EXIT  # a failing step ends the others

build_env() {  # FRAMEWORK: prints the environment's Python
  python3 - "$1" <<'PY'
import sys, time
from run_benchmarks.planning import envs
from run_benchmarks.errors import InputError
fw = sys.argv[1]
t = time.monotonic()
log = envs.cache_root() / f"build-{fw}.log"
log.parent.mkdir(parents=True, exist_ok=True)
try:
    py = envs.ensure_env("cpu", fw, log)
except InputError as exc:
    sys.exit(f"setup.sh: the {fw} environment: {exc}")
print(f"{fw} environment: {py} ({time.monotonic() - t:.0f} s)", file=sys.stderr)
print(py)
PY
}

# DeepSpeed JIT-builds its CPU shared-memory all-reduce (about a minute of compiling) in the
# first DeepSpeed run; the test session keeps it in tests.case_helpers.torch_extensions_dir(),
# where it is built here, by the same Python, so the runs find it built
build_shm_comm_op() {  # DEEPSPEED_PYTHON
  "$1" - <<'PY'
import os, sys, time
sys.path.insert(0, os.getcwd())
from tests.case_helpers import torch_extensions_dir
os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
t = time.monotonic()
from deepspeed.comm.torch import build_shm_op
if build_shm_op() is None:
    sys.exit(f"setup.sh: DeepSpeed has no CPU comm op for {sys.executable}")
print(f"DeepSpeed CPU comm op in {os.environ['TORCH_EXTENSIONS_DIR']} ({time.monotonic() - t:.0f} s)", file=sys.stderr)
PY
}

# the test cluster's hosts (and their containers) build it in their user's cache, with the
# environment's ninja first on PATH (node_agent puts the environment's bin/ there): built here
# the same way, the first DeepSpeed run on the hosts finds it (about a minute and a half of
# compiling on two hosts at once otherwise)
build_hosts_comm_op() {  # DEEPSPEED_PYTHON
  env -u TORCH_EXTENSIONS_DIR PATH="$(dirname "$1"):$PATH" "$1" - <<'PY'
import os, sys, time
t = time.monotonic()
from deepspeed.comm.torch import build_shm_op
if build_shm_op() is None:
    sys.exit(f"setup.sh: DeepSpeed has no CPU comm op for {sys.executable}")
print(f"DeepSpeed CPU comm op for the test cluster's hosts ({time.monotonic() - t:.0f} s)", file=sys.stderr)
PY
}

deepspeed_with_op() {
  local py
  py=$(build_env deepspeed) && build_shm_comm_op "$py" >/dev/null && build_hosts_comm_op "$py" >/dev/null
}

background() {  # WHAT COMMAND...: run in the background, remembered for the wait below
  local what=$1
  shift
  "$@" &
  jobs_+=("$what $!")
}

background "the megatron environment" build_env megatron >/dev/null
background "the deepspeed environment and its CPU comm op" deepspeed_with_op
background "the paddle environment" build_env paddle >/dev/null

if [ "$(id -u)" = 0 ]; then
  bash tests/install_system_deps.sh      # sshd, dockerd, debootstrap, Slurm, munge, Chromium
  background "the test cluster's base image" python3 -m tests.cluster.baseimage
fi

python3 -m pip install --disable-pip-version-check -q -e ".[test]"

failed=()
for j in "${jobs_[@]}"; do
  wait "${j##* }" || failed+=("${j% *}")
done
trap - EXIT
if [ "${#failed[@]}" -gt 0 ]; then
  printf 'setup.sh: not built: %s\n' "${failed[@]}" >&2
  exit 1
fi
