{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "vllm-autotuner.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: "<release>-<chart>" unless the release name already contains the chart name. */}}
{{- define "vllm-autotuner.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "vllm-autotuner.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (helm.sh chart_best_practices/labels). */}}
{{- define "vllm-autotuner.labels" -}}
helm.sh/chart: {{ include "vllm-autotuner.chart" . }}
{{ include "vllm-autotuner.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: vllm-autotuner
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "vllm-autotuner.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-autotuner.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vllm-autotuner.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vllm-autotuner.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "vllm-autotuner.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Operator pods: kopf has no leader election, so more than one pod needs peering. */}}
{{- define "vllm-autotuner.replicas" -}}
{{- if .Values.peering.enabled }}
{{- max 2 (int .Values.replicaCount) }}
{{- else if gt (int .Values.replicaCount) 1 }}
{{- fail "replicaCount > 1 needs peering.enabled=true: two standalone kopf operators would tune the same objects" }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{- define "vllm-autotuner.peeringName" -}}
{{- default (include "vllm-autotuner.fullname" .) .Values.peering.name }}
{{- end }}

{{/* Prometheus secrets are mounted at fixed paths the operator flags point to. */}}
{{- define "vllm-autotuner.tokenDir" -}}/var/run/secrets/vllm-autotuner/prometheus-token{{- end }}
{{- define "vllm-autotuner.caDir" -}}/etc/vllm-autotuner/prometheus-ca{{- end }}

{{/*
RBAC rules for the namespaced objects the operator reads and writes. Used by the ClusterRole
(all namespaces) or by one Role per watched namespace. Keep tests/support/helm.py in step.
*/}}
{{- define "vllm-autotuner.namespacedRules" -}}
- apiGroups: [vllm.autotuner.io]
  resources: [vllmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [vllm.autotuner.io]
  resources: [vllmdeployments/status]
  verbs: [patch]
# blockOwnerDeletion on children needs this where OwnerReferencesPermissionEnforcement is on
# (OpenShift; kubernetes/kubernetes#49133).
- apiGroups: [vllm.autotuner.io]
  resources: [vllmdeployments/finalizers]
  verbs: [update]
# Children are read through watches; server-side apply needs create (first apply) and patch.
# get: before creating a child, whether its name is taken by an object the operator does not
# own (it is then left untouched and reported as a NameConflict); and the Deployment's
# managedFields once, to hand spec.replicas to an autoscaler (docs/autoscaling.md).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
# Pod health (CrashLoopBackOff, OOMKilled, readiness) judges every trial; a pod counts only
# when a ReplicaSet of the operator's Deployment controls it, so ReplicaSets are watched too.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list, watch]
{{ include "vllm-autotuner.eventRules" . }}
{{- end }}

{{/* kopf posts the operator's Events as core/v1 Events. */}}
{{- define "vllm-autotuner.eventRules" -}}
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
