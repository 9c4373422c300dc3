{{/* Names and labels shared by every template. */}}

{{- define "grpo-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "grpo-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "grpo-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the operator pod: stable across upgrades. */}}
{{- define "grpo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "grpo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "grpo-operator.labels" -}}
helm.sh/chart: {{ include "grpo-operator.chart" . }}
{{ include "grpo-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: grpo-operator
{{- end -}}

{{/* Labels of objects that are not the operator pod (RBAC, monitors, dashboards). */}}
{{- define "grpo-operator.commonLabels" -}}
helm.sh/chart: {{ include "grpo-operator.chart" . }}
app.kubernetes.io/name: {{ include "grpo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: grpo-operator
{{- end -}}

{{- define "grpo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "grpo-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "grpo-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces a namespaced-mode operator watches, as a JSON list (default: the release's). */}}
{{- define "grpo-operator.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* A map of labels as a `grpo operator` selector flag value: k=v,k2=v2 (sorted by key). */}}
{{- define "grpo-operator.selectorFlag" -}}
{{- $parts := list -}}
{{- range $key, $value := . -}}
{{- $parts = append $parts (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{/* Where the Prometheus operator should look for run pods (PodMonitor namespaceSelector). */}}
{{- define "grpo-operator.runNamespaceSelector" -}}
{{- if eq .Values.watch.mode "cluster" -}}
any: true
{{- else -}}
matchNames:
{{- range (include "grpo-operator.watchedNamespaces" . | fromJsonArray) }}
  - {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
Labels the operator puts on a run's pods (operator/grpo_operator/builders.py; a test checks that
these selectors match the pods the builders make).
*/}}
{{- define "grpo-operator.serverPodSelector" -}}
app.kubernetes.io/managed-by: grpo-operator
grpo.dev/component: server
{{- end -}}

{{- define "grpo-operator.trainerPodSelector" -}}
app.kubernetes.io/managed-by: grpo-operator
grpo.dev/component: trainer
{{- end -}}

{{/* Container port names on those pods (builders.py). */}}
{{- define "grpo-operator.serverMetricsPort" -}}http{{- end -}}
{{- define "grpo-operator.trainerMetricsPort" -}}metrics{{- end -}}
