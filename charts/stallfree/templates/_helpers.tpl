{{/* Chart name, cut to 63 characters (the DNS label limit). */}}
{{- define "stallfree.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "stallfree.fullname" -}}
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

{{- define "stallfree.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the chart. */}}
{{- define "stallfree.labels" -}}
helm.sh/chart: {{ include "stallfree.chart" . }}
{{ include "stallfree.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator pod. */}}
{{- define "stallfree.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stallfree.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "stallfree.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stallfree.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The rules the operator needs, and no more: it reads and patches SarathiDeployments (status and kopf's
annotations), server-side-applies their children, prunes children the spec no longer wants, reads pods
for status, and posts Events.
*/}}
{{- define "stallfree.rules" -}}
- apiGroups: [serving.stallfree.dev]
  resources: [sarathideployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.stallfree.dev]
  resources: [sarathideployments/status]
  verbs: [get, patch]
- apiGroups: [serving.stallfree.dev]
  resources: [sarathideployments/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, list, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, create, patch, delete]
{{- end }}

{{/* kopf watches CustomResourceDefinitions to notice optional APIs appearing (read-only). */}}
{{- define "stallfree.crdReaderRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
