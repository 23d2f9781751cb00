#!/usr/bin/env bash
# Scenario 1 on kind: vLLM's defaults violate the ITL SLO under long-prompt traffic; the
# operator must commit a trial and report SLOMet=True within TIMEOUT seconds (default 900).
# Prints status and Events at the end; exit status 0 only when the loop converged.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need kubectl
TIMEOUT="${TIMEOUT:-900}"

report() {
  log "status of ${NAME}:"
  k -n "${NAMESPACE}" get "${CR}" -o jsonpath='{.status}' | head -c 20000 || true
  echo
  log "Events of ${NAME}:"
  k -n "${NAMESPACE}" get events --field-selector "involvedObject.name=${NAME}" \
    --sort-by=.lastTimestamp || true
}

pods_ready() {
  [[ "$(k -n "${NAMESPACE}" get deployment "${NAME}" \
    -o jsonpath='{.status.availableReplicas}' 2>/dev/null)" == "2" ]]
}

committed_trials() {
  k -n "${NAMESPACE}" get "${CR}" \
    -o jsonpath='{range .status.tuning.trials[?(@.outcome=="Committed")]}{.id}{"\n"}{end}' \
    | grep -c . || true
}

converged() {
  local met phase
  met="$(k -n "${NAMESPACE}" get "${CR}" \
    -o jsonpath='{.status.conditions[?(@.type=="SLOMet")].status}')"
  phase="$(k -n "${NAMESPACE}" get "${CR}" -o jsonpath='{.status.tuning.phase}')"
  log "phase=${phase:-?} SLOMet=${met:-?} committed=$(committed_trials)"
  [[ "${met}" == "True" && "$(committed_trials)" -ge 1 ]] \
    && [[ "${phase}" != "RollingOut" && "${phase}" != "Verifying" && "${phase}" != "Promoting" ]]
}

log "applying the policy and the VLLMDeployment"
k apply -f "${MANIFESTS}/policy.yaml"
k apply -f "${MANIFESTS}/vllmdeployment.yaml"
wait_until 300 "the Deployment ${NAME} available" pods_ready

log "starting the load Job"
k -n "${NAMESPACE}" delete job load --ignore-not-found
k apply -f "${MANIFESTS}/load-job.yaml"

if wait_until "${TIMEOUT}" "a committed trial and SLOMet=True" converged; then
  report
  log "scenario 1 passed"
else
  report
  log "operator log (last 100 lines):"
  k -n "${OPERATOR_NAMESPACE}" logs deployment/"${RELEASE}" --tail=100 || true
  die "scenario 1 did not converge within ${TIMEOUT}s"
fi
