#!/usr/bin/env bash
# Delete the kind cluster (and with it everything the scenario created).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need kind
if kind get clusters 2>/dev/null | grep -qx "${CLUSTER_NAME}"; then
  kind delete cluster --name "${CLUSTER_NAME}"
else
  log "no kind cluster ${CLUSTER_NAME}"
fi
