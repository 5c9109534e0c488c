{{/* Names and labels. */}}
{{- define "steamrf.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "steamrf.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "steamrf.labels" -}}
app.kubernetes.io/name: {{ include "steamrf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include with (list $ "pipeline"). */}}
{{- define "steamrf.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "steamrf.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "steamrf.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "steamrf.fullname" .)) -}}
{{- end -}}

{{/* The image; (list $ true) for the CUDA variant. */}}
{{- define "steamrf.image" -}}
{{- $root := index . 0 -}}
{{- $tag := $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- if index . 1 }}{{ $tag = printf "%s-cuda" $tag }}{{ end -}}
{{ printf "%s:%s" $root.Values.image.repository $tag }}
{{- end -}}

{{/* Pod annotations: a config change rolls the pods. */}}
{{- define "steamrf.podAnnotations" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{/* Environment of every container. */}}
{{- define "steamrf.env" -}}
- name: STEAMRF_CONFIG
  value: /etc/steamrf/steamrf.toml
- name: STEAMRF_LOG
  value: "warn,steamrf=info,steamrf_pipelines=info"
{{- range $k, $v := .Values.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "steamrf.envFrom" -}}
- secretRef:
    name: {{ include "steamrf.secretName" . }}
    optional: true
{{- end -}}

{{/* Volumes: the config, a writable /tmp, and the Kafka TLS files if any. */}}
{{- define "steamrf.volumes" -}}
- name: config
  configMap:
    name: {{ include "steamrf.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- with .Values.secrets.kafkaTlsSecret }}
- name: kafka-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{- define "steamrf.volumeMounts" -}}
- name: config
  mountPath: /etc/steamrf
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.secrets.kafkaTlsSecret }}
- name: kafka-tls
  mountPath: /etc/steamrf-kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Probes on a port's /healthz and /readyz. */}}
{{- define "steamrf.probes" -}}
livenessProbe:
  httpGet: {path: /healthz, port: {{ . }}}
  periodSeconds: 10
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /readyz, port: {{ . }}}
  periodSeconds: 5
  failureThreshold: 3
startupProbe:
  httpGet: {path: /healthz, port: {{ . }}}
  periodSeconds: 5
  failureThreshold: 60
{{- end -}}

{{/* Scheduling of a pod; (list $ gpu?) */}}
{{- define "steamrf.scheduling" -}}
{{- $root := index . 0 -}}
{{- $gpu := and (index . 1) $root.Values.gpu.enabled -}}
{{- $selector := $root.Values.nodeSelector -}}
{{- if $gpu }}{{ $selector = merge (deepCopy $root.Values.gpu.nodeSelector) $root.Values.nodeSelector }}{{ end -}}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $root.Values.tolerations -}}
{{- if $gpu }}{{ $tolerations = concat $root.Values.tolerations $root.Values.gpu.tolerations }}{{ end -}}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Container resources; (list $ resources gpu?) */}}
{{- define "steamrf.resources" -}}
{{- $root := index . 0 -}}
{{- $res := deepCopy (index . 1) -}}
{{- if and (index . 2) $root.Values.gpu.enabled -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" $root.Values.gpu.count -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{ toYaml $res }}
{{- end -}}
