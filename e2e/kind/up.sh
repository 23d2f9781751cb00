#!/usr/bin/env bash
# Create the kind cluster and install everything scenario 1 needs:
#   the operator and vllm-sim images (built from the repository's Dockerfile and loaded into
#   kind), a minimal Prometheus with Kubernetes pod discovery, and the Helm chart.
# Idempotent: an existing cluster is reused, releases are upgraded.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need docker kind kubectl helm

if kind get clusters 2>/dev/null | grep -qx "${CLUSTER_NAME}"; then
  log "reusing kind cluster ${CLUSTER_NAME}"
else
  log "creating kind cluster ${CLUSTER_NAME}"
  kind create cluster --name "${CLUSTER_NAME}" --config "${MANIFESTS}/kind-config.yaml" --wait 120s
fi

log "building ${OPERATOR_IMAGE} and ${SIM_IMAGE} from ${REPO_ROOT}/Dockerfile"
docker build --target operator -t "${OPERATOR_IMAGE}" "${REPO_ROOT}"
docker build --target vllm-sim -t "${SIM_IMAGE}" "${REPO_ROOT}"
kind load docker-image --name "${CLUSTER_NAME}" "${OPERATOR_IMAGE}" "${SIM_IMAGE}"

log "namespaces and Prometheus"
k apply -f "${MANIFESTS}/namespace.yaml"
k apply -f "${MANIFESTS}/prometheus.yaml"
k -n monitoring rollout status deployment/prometheus --timeout=180s

log "installing the chart (release ${RELEASE} in ${OPERATOR_NAMESPACE})"
helm --kube-context "${KUBE_CONTEXT}" upgrade --install "${RELEASE}" \
  "${REPO_ROOT}/charts/vllm-autotuner" \
  --namespace "${OPERATOR_NAMESPACE}" --create-namespace \
  --values "${MANIFESTS}/operator-values.yaml" \
  --wait --timeout 180s
k wait --for=condition=Established --timeout=60s \
  crd/vllmdeployments.vllm.autotuner.io crd/vllmtuningpolicies.vllm.autotuner.io
log "cluster ready; next: e2e/kind/scenario1.sh"
