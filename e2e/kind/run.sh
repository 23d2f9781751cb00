#!/usr/bin/env bash
# up.sh, scenario1.sh, then down.sh (skipped with KEEP=1, to look around afterwards).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

cleanup() {
  if [[ "${KEEP:-0}" != "1" ]]; then
    "${HERE}/down.sh"
  fi
}
trap cleanup EXIT

"${HERE}/up.sh"
"${HERE}/scenario1.sh"
