#!/usr/bin/env bash
# System packages the report tests need: a headless Chromium to open the
# nightly report page.  Idempotent: does nothing when chromium is installed.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_report_deps.sh: chromium is missing and installing it needs root" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# wait for other package installs on this machine instead of failing on the lock
apt-get -o DPkg::Lock::Timeout=600 update -q
apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends chromium fonts-dejavu-core
command -v chromium >/dev/null
