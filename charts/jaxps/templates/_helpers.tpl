{{- define "jaxps.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "jaxps.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "jaxps.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "jaxps.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "jaxps.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* What the operator does in a namespace it serves: nothing more. */}}
{{- define "jaxps.namespacedRules" -}}
- apiGroups: [jaxps.dev]
  resources: [trainingjobs]
  verbs: [get, list, watch, delete]
- apiGroups: [jaxps.dev]
  resources: [trainingjobs/status]
  verbs: [get, update, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create]
# the job's Events; list: the kubelet's Warnings on a pod that does not start (FailedMount)
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch, list]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [get, update, patch]
{{- end }}
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create]
{{- end }}
{{- end -}}
