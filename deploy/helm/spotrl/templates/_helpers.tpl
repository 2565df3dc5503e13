{{/*
Names, labels, and the pieces every spotrl container shares: its environment (the SPOTRL_*
settings of the services' settings classes), its security context, its probes and its writable folders.
*/}}

{{- define "spotrl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The ports each service binds (fixed: the Services, probes and policies name them). */}}
{{- define "spotrl.ports" -}}
coordinator: 8100
weightstore: 8200
blocks: 8201
trainer: 8300
rollout: 8400
peers: 8401
redis: 6379
{{- end -}}

{{/* Labels that select a component's pods: (dict "root" $ "component" NAME ["pool" NAME]) */}}
{{- define "spotrl.selectorLabels" -}}
app.kubernetes.io/name: spotrl
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
spotrl/pool: {{ .pool }}
{{- end }}
{{- end -}}

{{- define "spotrl.labels" -}}
{{ include "spotrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* Every pod of this release (NetworkPolicy peers). */}}
{{- define "spotrl.releaseLabels" -}}
app.kubernetes.io/name: spotrl
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "spotrl.image" -}}
{{- $image := .image | default .root.Values.image -}}
{{- if eq (toString $image.tag) "latest" -}}
{{- fail "image tags are pinned: \"latest\" is refused (set image.tag)" -}}
{{- end -}}
{{- printf "%s:%s" $image.repository (toString $image.tag) -}}
{{- end -}}

{{- define "spotrl.tokenSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-token" (include "spotrl.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.tokenKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* The checks every render makes before it writes anything. */}}
{{- define "spotrl.validate" -}}
{{- include "spotrl.validateSecurity" . -}}
{{- include "spotrl.validateAutoscaling" . -}}
{{- include "spotrl.validatePlatform" . -}}
{{- include "spotrl.validateFailover" . -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "redis.url names a managed Redis: set redis.enabled=false with it" -}}
{{- end -}}
{{- if not (or .Values.redis.enabled .Values.redis.url) -}}
{{- fail "redis.enabled=false needs redis.url (a managed Redis)" -}}
{{- end -}}
{{- $ws := .Values.weightstore -}}
{{- if and (gt (int $ws.replicas) 1) (not $ws.persistence.existingClaim) (not (has "ReadWriteMany" $ws.persistence.accessModes)) -}}
{{- fail "weightstore.replicas > 1 share one volume: set weightstore.persistence.accessModes to [ReadWriteMany]" -}}
{{- end -}}
{{- if and .Values.gpu.enabled (lt (int .Values.trainer.gpus) (int .Values.trainer.ranks)) -}}
{{- fail "trainer.ranks > trainer.gpus: one rank per GPU" -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.rollout.pools -}}
{{- if has .name $names -}}
{{- fail (printf "rollout.pools: the name %q is used twice" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- end -}}

{{/* What every spotrl container sets: where the others are, its credentials, the bind address,
its TLS files: (dict "root" $ "component" NAME). */}}
{{- define "spotrl.commonEnv" -}}
{{- $root := .root -}}
{{- $full := include "spotrl.fullname" $root -}}
{{- $ports := include "spotrl.ports" $root | fromYaml -}}
{{- $scheme := include "spotrl.scheme" $root -}}
- name: SPOTRL_HOST
  value: "0.0.0.0"
{{- include "spotrl.authEnv" . }}
- name: SPOTRL_PROTECT_READS
  value: {{ $root.Values.auth.protectReads | toString | quote }}
{{- include "spotrl.redisEnv" . }}
- name: SPOTRL_COORDINATOR_URL
  value: {{ printf "%s://%s-coordinator:%v" $scheme $full $ports.coordinator | quote }}
- name: SPOTRL_WEIGHTSTORE_URL
  value: {{ printf "%s://%s-weightstore:%v" $scheme $full $ports.weightstore | quote }}
- name: SPOTRL_LOG_LEVEL
  value: {{ $root.Values.logLevel | quote }}
{{- include "spotrl.tlsEnv" $root }}
{{- end -}}

{{/* A component's own settings by field name: (dict "settings" MAP "indent" N) */}}
{{- define "spotrl.settingsEnv" -}}
{{- range $name, $value := .settings }}
{{ printf "- name: SPOTRL_%s" (upper $name) | indent $.indent }}
{{ printf "  value: %s" ($value | toString | quote) | indent $.indent }}
{{- end }}
{{- end -}}

{{- define "spotrl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "spotrl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Probes through the image's own check: it asks this container's /healthz on SPOTRL_PORT. */}}
{{- define "spotrl.probes" -}}
{{- $check := list "python" "-m" "services.infra.healthcheck" -}}
startupProbe:
  exec:
    command: {{ toJson $check }}
  periodSeconds: 5
  timeoutSeconds: 4
  failureThreshold: {{ .startupFailures | default 60 }}
readinessProbe:
  exec:
    command: {{ toJson $check }}
  periodSeconds: 10
  timeoutSeconds: 4
  failureThreshold: 3
livenessProbe:
  exec:
    command: {{ toJson $check }}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The folders a read-only root leaves writable: /tmp and the home (caches of torch, HF). */}}
{{- define "spotrl.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/spotrl
{{- end -}}

{{- define "spotrl.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 2Gi
- name: home
  emptyDir:
    sizeLimit: 2Gi
{{- end -}}

{{/* The reserved node pool's placement: (dict "root" $ ["tolerations" LIST] ["models" true]).
"models": the pod mounts the models claim, which on ReadWriteOnce keeps it on the node of the
other pod mounting it (a required pod affinity; the first of them goes anywhere). */}}
{{- define "spotrl.reservedPlacement" -}}
{{- $root := .root -}}
{{- with $root.Values.reserved.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with concat $root.Values.reserved.tolerations (.tolerations | default list) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := include "spotrl.reservedAffinity" (dict "root" $root "affinity" $root.Values.reserved.affinity) | fromYaml }}
{{- if and .models (include "spotrl.modelsOneNode" $root) }}
{{- $term := dict "labelSelector" (dict "matchLabels" (include "spotrl.modelsLabels" $root | fromYaml)) "topologyKey" "kubernetes.io/hostname" }}
{{- $pod := $affinity.podAffinity | default dict }}
{{- $required := get $pod "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ := set $pod "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) }}
{{- $_ := set $affinity "podAffinity" $pod }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* "true" when the models claim attaches to one node at a time (no ReadWriteMany or
ReadOnlyMany among models.accessModes): its pods then share a node. */}}
{{- define "spotrl.modelsOneNode" -}}
{{- $modes := .Values.models.accessModes -}}
{{- if not (or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes)) }}true{{ end -}}
{{- end -}}

{{/* The labels of the pods that mount the models claim (their pod affinity selects them). */}}
{{- define "spotrl.modelsLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
spotrl/mounts-models: "true"
{{- end -}}

{{/* Resources with the GPUs added: (dict "resources" MAP "gpus" N "root" $) */}}
{{- define "spotrl.resources" -}}
{{- $res := deepCopy .resources -}}
{{- if and .root.Values.gpu.enabled (gt (int .gpus) 0) -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits .root.Values.gpu.resourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $requests := $res.requests | default dict -}}
{{- $_ := set $requests .root.Values.gpu.resourceName (int .gpus) -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "spotrl.pvc" -}}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ .name }}
  labels:
    {{- include "spotrl.labels" (dict "root" .root "component" .component) | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
spec:
  accessModes:
    {{- toYaml .persistence.accessModes | nindent 4 }}
  {{- with .persistence.storageClassName }}
  storageClassName: {{ . }}
  {{- end }}
  resources:
    requests:
      storage: {{ .persistence.size }}
{{- end -}}
