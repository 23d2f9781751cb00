#!/usr/bin/env bash
# Shared settings and helpers of the kind scripts; sourced, never run.
# shellcheck shell=bash disable=SC2034  # the settings are used by the scripts that source this

KIND_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${KIND_DIR}/../.." && pwd)"
MANIFESTS="${KIND_DIR}/manifests"

CLUSTER_NAME="${CLUSTER_NAME:-vllm-autotuner-e2e}"
KUBE_CONTEXT="kind-${CLUSTER_NAME}"
NAMESPACE="vllm-e2e"
RELEASE="vllm-autotuner"
OPERATOR_NAMESPACE="vllm-autotuner-system"
OPERATOR_IMAGE="vllm-autotuner:e2e"
SIM_IMAGE="vllm-sim:e2e"
NAME="demo"
CR="vllmdeployments.vllm.autotuner.io/${NAME}"

log() {
  printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

die() {
  log "error: $*"
  exit 1
}

need() {
  local tool
  for tool in "$@"; do
    command -v "${tool}" >/dev/null 2>&1 || die "${tool} is required (see e2e/README.md)"
  done
}

k() {
  kubectl --context "${KUBE_CONTEXT}" "$@"
}

# wait_until SECONDS DESCRIPTION COMMAND...: run COMMAND every 5 s until it succeeds.
wait_until() {
  local timeout="$1" what="$2"
  shift 2
  local deadline=$((SECONDS + timeout))
  until "$@"; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${timeout}s waiting for ${what}"
      return 1
    fi
    sleep 5
  done
  log "${what}: done"
}
