{{/* Names and labels shared by every resource. */}}
{{- define "sluice.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "root" $ "component" "worker"). */}}
{{- define "sluice.selector" -}}
app.kubernetes.io/name: {{ include "sluice.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sluice.secretName" -}}
{{- default (printf "%s-secrets" (include "sluice.fullname" .)) .Values.existingSecret -}}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: include with (dict "root" $ "image" .Values.producer.image "tag" "x"). */}}
{{- define "sluice.image" -}}
{{- $repo := .image.repository -}}
{{- if .root.Values.imageRegistry -}}{{- $repo = printf "%s/%s" (trimSuffix "/" .root.Values.imageRegistry) $repo -}}{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .tag .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "sluice.workerTag" -}}
{{- printf "%s-%s" .Chart.AppVersion (ternary (printf "cuda%s" .Values.worker.gpu.cuda) "cpu" .Values.worker.gpu.enabled) -}}
{{- end -}}

{{/* The worker pod's grace period: the drain, plus a margin for committing and leaving. */}}
{{- define "sluice.workerGracePeriod" -}}
{{- add .Values.worker.shutdownGraceSeconds .Values.worker.terminationMarginSeconds -}}
{{- end -}}

{{/* A value from the Secret, absent when the key is. */}}
{{- define "sluice.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "sluice.secretName" .root }}
      key: {{ .key }}
      optional: true
{{- end -}}

{{/* Kafka, S3 and logging settings both services take. */}}
{{- define "sluice.commonEnv" -}}
- name: SLUICE_KAFKA_BROKERS
  value: {{ required "kafka.brokers is required" .Values.kafka.brokers | quote }}
{{- if .Values.kafka.options }}
- name: SLUICE_KAFKA_OPTIONS
  value: {{ include "sluice.kafkaOptions" . | quote }}
{{- else }}
{{ include "sluice.secretEnv" (dict "root" . "name" "SLUICE_KAFKA_OPTIONS" "key" "kafka-options") }}
{{- end }}
- name: SLUICE_TASKS_TOPIC
  value: {{ .Values.kafka.topics.tasks | quote }}
{{- with .Values.kafka.topics }}
{{- if and .interactive (eq .interactive (.batch | default "")) }}
{{- fail "kafka.topics.interactive and kafka.topics.batch name one topic: the batch lane's backlog would stand in front of interactive tasks again; give each its own, or leave kafka.topics.batch empty" }}
{{- end }}
{{- end }}
- name: SLUICE_INTERACTIVE_TOPIC
  value: {{ .Values.kafka.topics.interactive | default "" | quote }}
- name: SLUICE_BATCH_TOPIC
  value: {{ .Values.kafka.topics.batch | default "" | quote }}
- name: SLUICE_COMPLETIONS_TOPIC
  value: {{ .Values.kafka.topics.completions | quote }}
- name: SLUICE_PROGRESS_TOPIC
  value: {{ .Values.kafka.topics.progress | quote }}
- name: SLUICE_CONTROL_TOPIC
  value: {{ .Values.kafka.topics.control | quote }}
- name: SLUICE_DLQ_TOPIC
  value: {{ .Values.kafka.topics.dlq | quote }}
- name: SLUICE_OUTPUT_URL
  value: {{ required "s3.outputUrl is required" .Values.s3.outputUrl | quote }}
{{- with .Values.s3.inputUrl }}
- name: SLUICE_INPUT_URL
  value: {{ . | quote }}
{{- end }}
- name: SLUICE_MODEL_CATALOG
  value: /etc/sluice/catalog/models.toml
- name: SLUICE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: AWS_REGION
  value: {{ .Values.s3.region | quote }}
{{- if .Values.s3.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ .Values.s3.endpoint | quote }}
{{- end }}
{{- if .Values.s3.allowHttp }}
- name: AWS_ALLOW_HTTP
  value: "true"
{{- end }}
{{ include "sluice.secretEnv" (dict "root" . "name" "AWS_ACCESS_KEY_ID" "key" "aws-access-key-id") }}
{{ include "sluice.secretEnv" (dict "root" . "name" "AWS_SECRET_ACCESS_KEY" "key" "aws-secret-access-key") }}
{{- end -}}

{{/* kafka.options as key=value,... (sorted, so renders are stable). */}}
{{- define "sluice.kafkaOptions" -}}
{{- $pairs := list -}}
{{- range $k, $v := .Values.kafka.options -}}{{- $pairs = append $pairs (printf "%s=%v" $k $v) -}}{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Volumes and mounts both services take. */}}
{{- define "sluice.commonVolumes" -}}
- name: catalog
  configMap:
    name: {{ include "sluice.fullname" . }}-catalog
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if .Values.kafka.tlsSecretName }}
- name: kafka-tls
  secret:
    secretName: {{ .Values.kafka.tlsSecretName }}
{{- end }}
{{- end -}}

{{- define "sluice.commonMounts" -}}
- name: catalog
  mountPath: /etc/sluice/catalog
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.kafka.tlsSecretName }}
- name: kafka-tls
  mountPath: /etc/sluice/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* A per-pod scratch volume: emptyDir, or a generic ephemeral volume from a storage class. */}}
{{- define "sluice.scratchVolume" -}}
- name: {{ .name }}
{{- if eq .spec.volume "ephemeral" }}
  ephemeral:
    volumeClaimTemplate:
      spec:
        accessModes: [ReadWriteOnce]
        {{- if .spec.storageClassName }}
        storageClassName: {{ .spec.storageClassName }}
        {{- end }}
        resources:
          requests:
            storage: {{ .spec.size }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .spec.size }}
{{- end }}
{{- end -}}

{{/* checkov skips of a workload, each with its reason: include with (dict "image" .Values.worker.image "secrets" true). */}}
{{- define "sluice.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_15=Images are pinned by tag or digest; IfNotPresent spares re-pulling multi-GB CUDA images on every GPU pod start
{{- if .secrets }}
checkov.io/skip2: CKV_K8S_35=The binaries read these from the environment (object_store reads only AWS_* variables); they come from a Secret by secretKeyRef, never from values in plain text
{{- end }}
{{- if not .image.digest }}
checkov.io/skip3: CKV_K8S_43=Pinning by digest is image.digest; without it the chart's appVersion tag is used
{{- end }}
{{- end -}}
