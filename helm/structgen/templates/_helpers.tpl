{{/* Names, labels and the few derived values every template shares. */}}

{{- define "structgen.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "structgen.fullname" -}}
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

{{/* Room for the "-headless" suffix within the 63-character Service name limit. */}}
{{- define "structgen.headlessName" -}}
{{- printf "%s-headless" (include "structgen.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "structgen.selectorLabels" -}}
app.kubernetes.io/name: {{ include "structgen.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The `helm test` pod: the NetworkPolicy lets it reach the gRPC port. */}}
{{- define "structgen.testSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
{{- end }}

{{- define "structgen.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "structgen.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "structgen.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "structgen.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "<appVersion>-gpu" or "<appVersion>-cpu" unless image.tag is set. */}}
{{- define "structgen.image" -}}
{{- $variant := ternary "gpu" "cpu" .Values.gpu.enabled }}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "structgen.grammarImage" -}}
{{- if or .Values.grammar.image.repository .Values.grammar.image.tag }}
{{- $variant := ternary "gpu" "cpu" .Values.gpu.enabled }}
{{- $repo := default .Values.image.repository .Values.grammar.image.repository }}
{{- $tag := default (default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag) .Values.grammar.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- else }}
{{- include "structgen.image" . }}
{{- end }}
{{- end }}

{{/* The control socket both containers share (the "socket" emptyDir at /run/structgen). */}}
{{- define "structgen.grammarAddress" -}}
unix:///run/structgen/grammar.sock
{{- end }}

{{/* Kubelet grpc probes speak neither TLS nor bearer tokens: with either enabled they
     go to the plaintext health-only port instead of the public one. */}}
{{- define "structgen.probePort" -}}
{{- if or .Values.tls.enabled .Values.auth.enabled }}
{{- .Values.ports.health }}
{{- else }}
{{- .Values.ports.grpc }}
{{- end }}
{{- end }}

{{- define "structgen.clientCASecret" -}}
{{- default .Values.tls.secretName .Values.tls.clientCA.secretName }}
{{- end }}

{{/* OTEL resource attributes: k8s identity from the downward API plus values. */}}
{{- define "structgen.otelResourceAttributes" -}}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" (printf "k8s.container.name=%s" .container) "service.instance.id=$(POD_NAME)" }}
{{- range $k, $v := .root.Values.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $attrs }}
{{- end }}

{{/* Env shared by both containers; .container names the container. */}}
{{- define "structgen.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ include "structgen.otelResourceAttributes" . | quote }}
# The root filesystem is read-only: caches go to the /tmp emptyDir.
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
{{- end }}

{{/* A value as an environment variable's text: integers without an exponent (a values.yaml
     number is a float64: 262144 would print as 2.62144e+05), booleans as true/false. */}}
{{- define "structgen.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* Cross-field rules the JSON schema cannot express; called from the Deployment. */}}
{{- define "structgen.validate" -}}
{{- $grace := int .Values.terminationGracePeriodSeconds }}
{{- $genDone := add .Values.generation.preStopDelaySeconds .Values.generation.drainSeconds }}
{{- if ge (int $genDone) $grace }}
{{- fail (printf "generation.preStopDelaySeconds + generation.drainSeconds (%d) must be below terminationGracePeriodSeconds (%d)" (int $genDone) $grace) }}
{{- end }}
{{- if lt (int .Values.grammar.drainDelaySeconds) (int $genDone) }}
{{- fail (printf "grammar.drainDelaySeconds (%d) must cover generation.preStopDelaySeconds + generation.drainSeconds (%d): constrained streams need the grammar sidecar until they finish" (int .Values.grammar.drainDelaySeconds) (int $genDone)) }}
{{- end }}
{{- if ge (int .Values.grammar.drainDelaySeconds) $grace }}
{{- fail (printf "grammar.drainDelaySeconds (%d) must be below terminationGracePeriodSeconds (%d)" (int .Values.grammar.drainDelaySeconds) $grace) }}
{{- end }}
{{- /* int: a --set value is an int64, a values.yaml one a float64; uniq tells them apart. */}}
{{- $ports := list (int .Values.ports.grpc) (int .Values.ports.metrics) (int .Values.ports.health) }}
{{- if .Values.grammar.metrics.enabled }}{{- $ports = append $ports (int .Values.grammar.metrics.port) }}{{- end }}
{{- if eq .Values.grammar.healthProbe.type "grpc" }}{{- $ports = append $ports (int .Values.grammar.healthProbe.port) }}{{- end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "container ports must be distinct within the pod, got %v" $ports) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not .Values.autoscaling.targetCPUUtilizationPercentage) (not .Values.autoscaling.metrics) }}
{{- fail "autoscaling.enabled needs targetCPUUtilizationPercentage or at least one entry in autoscaling.metrics" }}
{{- end }}
{{- end }}
