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

{{/* The image; (list $ true) for the CUDA variant. A digest pins it. */}}
{{- define "steamrf.image" -}}
{{- $root := index . 0 -}}
{{- $cuda := index . 1 -}}
{{- $digest := ternary $root.Values.image.cudaDigest $root.Values.image.digest $cuda -}}
{{- if $digest -}}
{{- if not (hasPrefix "sha256:" $digest) }}{{ fail "image.digest and image.cudaDigest must look like sha256:<hex>" }}{{ end -}}
{{ printf "%s@%s" $root.Values.image.repository $digest }}
{{- else -}}
{{- $tag := $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- if $cuda }}{{ $tag = printf "%s-cuda" $tag }}{{ end -}}
{{ printf "%s:%s" $root.Values.image.repository $tag }}
{{- end -}}
{{- end -}}

{{- define "steamrf.kafkaSecretName" -}}
{{- .Values.secrets.existingKafkaSecret | default (printf "%s-kafka-secrets" (include "steamrf.fullname" .)) -}}
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

{{/* Secret environment; (list $ kafka?): Kafka credentials only for Kafka clients. */}}
{{- define "steamrf.envFrom" -}}
{{- $root := index . 0 -}}
- secretRef:
    name: {{ include "steamrf.secretName" $root }}
    optional: true
{{- if index . 1 }}
- secretRef:
    name: {{ include "steamrf.kafkaSecretName" $root }}
    optional: true
{{- end }}
{{- end -}}

{{/* Volumes: the config, a writable /tmp, and for Kafka clients, (list $ true), the Kafka TLS files if any. */}}
{{- define "steamrf.volumes" -}}
{{- $root := index . 0 -}}
- name: config
  configMap:
    name: {{ include "steamrf.fullname" $root }}-config
- name: tmp
  emptyDir: {}
{{- if index . 1 }}
{{- with $root.Values.secrets.kafkaTlsSecret }}
- name: kafka-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "steamrf.volumeMounts" -}}
{{- $root := index . 0 -}}
- name: config
  mountPath: /etc/steamrf
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if and (index . 1) $root.Values.secrets.kafkaTlsSecret }}
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
# steamrf never calls the Kubernetes API.
automountServiceAccountToken: false
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
