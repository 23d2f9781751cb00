#!/usr/bin/env bash
# Installs the Prometheus server from the OS package manager when it is missing.
# Debian's package would start a service on :9090 where an init system allows it; we never
# rely on that service (tests start their own server on 127.0.0.1 with a free port).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
if [ -x /usr/bin/prometheus ]; then exit 0; fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "error: Prometheus is missing and installing it needs root: apt-get install --no-install-recommends prometheus" >&2; exit 1
    fi
  fi
  echo "Installing Prometheus from the Debian archive (apt-get install --no-install-recommends prometheus)..."
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # Stop a service the package may have started; our tests run their own servers.
  if command -v invoke-rc.d >/dev/null 2>&1; then $SUDO invoke-rc.d prometheus stop >/dev/null 2>&1 || true; fi
  command -v prometheus >/dev/null 2>&1 || { echo "error: the prometheus package installed no binary" >&2; exit 1; }
else
  echo "error: Prometheus is missing. Install the 'prometheus' server (2.x or 3.x) with your OS package manager, or put its binary on PATH." >&2
  exit 1
fi
