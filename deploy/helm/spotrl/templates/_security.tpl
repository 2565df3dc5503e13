{{/*
Least privilege (issue 41): which credential each component gets, and nothing more.

Two Secrets of the user's, from the files of `spotrl secrets` (docs/deploy-kubernetes.md, "Least
privilege"; the chart never makes or reads a password):
- security.existingSecret, by key:
    aclfile                    Redis's ACL file: a user per role, the default user off
    redis-url-coordinator      rediss://spotrl-coordinator:PASSWORD@<fullname>-redis:6379/0
    redis-url-trainer          rediss://spotrl-trainer:PASSWORD@<fullname>-redis:6379/0
    redis-url-reader           rediss://spotrl-reader:PASSWORD@... (CLI status; no pod uses it)
    admin-token, worker-token, trainer-token, read-token    one API token per scope
    accept-coordinator, accept-weightstore, accept-trainer, accept-worker
                               SPOTRL_ACCEPT_TOKENS of each service: scope:sha256 entries
    redis-password-certs       the spotrl-certs user's password (PING, CONFIG SET): the Redis
                               pod's TLS reloader
- tls.existingSecret: ca.crt, tls.crt, tls.key (tls.rolloutSecret: the rollout pools' own), or
  the Secrets cert-manager writes (_certs.tpl).

Per component (`spotrl.grants`): the keys of security.existingSecret it may read. A rollout
worker (on spot) reads its worker token and its accept list only: no Redis password (the
coordinator gives it a user of its own at registration), no admin or trainer token.
*/}}

{{- define "spotrl.grants" -}}
coordinator:
  redis: redis-url-coordinator
  accept: accept-coordinator
weightstore:
  accept: accept-weightstore
trainer:
  redis: redis-url-trainer
  token: trainer-token
  accept: accept-trainer
rollout:
  token: worker-token
  accept: accept-worker
{{- end -}}

{{/* Where a pod finds its TLS files (the Secret's keys). */}}
{{- define "spotrl.tlsDir" -}}/etc/spotrl/tls{{- end -}}

{{/* The Secret a component's TLS files come from: (dict "root" $ "component" NAME) */}}
{{- define "spotrl.tlsSecret" -}}
{{- if eq .component "rollout" -}}
{{- include "spotrl.rolloutTlsSecret" .root -}}
{{- else -}}
{{- include "spotrl.serverTlsSecret" .root -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.scheme" -}}{{ ternary "https" "http" .Values.tls.enabled }}{{- end -}}

{{/* The Redis URL with no credentials: a rollout worker's (its user comes at registration). */}}
{{- define "spotrl.redisUrl" -}}
{{- if include "spotrl.failover" . -}}
{{- include "spotrl.sentinelUrl" . -}}
{{- else -}}
{{- $ports := include "spotrl.ports" . | fromYaml -}}
{{- $scheme := ternary "rediss" "redis" .Values.tls.enabled -}}
{{- printf "%s://%s-redis:%v/0" $scheme (include "spotrl.fullname" .) $ports.redis -}}
{{- end -}}
{{- end -}}

{{/* One variable from a key of security.existingSecret: (dict "root" $ "name" VAR "key" KEY) */}}
{{- define "spotrl.securityEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.security.existingSecret }}
      key: {{ .key }}
{{- end -}}

{{/* The token a component sends and those it accepts, or the one token of auth.token. */}}
{{- define "spotrl.authEnv" -}}
{{- $root := .root -}}
{{- if $root.Values.security.scopedTokens -}}
{{- $grant := get (include "spotrl.grants" $root | fromYaml) .component -}}
{{- if $grant.token }}
{{ include "spotrl.securityEnv" (dict "root" $root "name" "SPOTRL_TOKEN" "key" $grant.token) }}
{{- end }}
{{ include "spotrl.securityEnv" (dict "root" $root "name" "SPOTRL_ACCEPT_TOKENS" "key" $grant.accept) }}
{{- else }}
- name: SPOTRL_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "spotrl.tokenSecret" $root }}
      key: {{ include "spotrl.tokenKey" $root }}
{{- end }}
{{- end -}}

{{/* The Redis URL of a component. Under ACLs: its role's user from the Secret; a worker's URL
without credentials (its user comes at registration); none for the weight store (it keeps
nothing in Redis). Without ACLs, every component as before. */}}
{{- define "spotrl.redisEnv" -}}
{{- $root := .root -}}
{{- $full := include "spotrl.fullname" $root -}}
{{- $grant := get (include "spotrl.grants" $root | fromYaml) .component -}}
{{- if and $root.Values.security.redisAcl $grant.redis }}
{{ include "spotrl.securityEnv" (dict "root" $root "name" "SPOTRL_REDIS_URL" "key" $grant.redis) }}
{{- else if and $root.Values.security.redisAcl (ne .component "rollout") }}
{{- /* the weight store: no Redis URL at all */}}
{{- else if $root.Values.redis.enabled }}
- name: SPOTRL_REDIS_URL
  value: {{ include "spotrl.redisUrl" $root | quote }}
{{- else }}
- name: SPOTRL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $full }}-redis-url
      key: url
{{- end }}
{{- end -}}

{{- define "spotrl.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- $dir := include "spotrl.tlsDir" . }}
- name: SPOTRL_TLS_CERT_FILE
  value: {{ $dir }}/tls.crt
- name: SPOTRL_TLS_KEY_FILE
  value: {{ $dir }}/tls.key
- name: SPOTRL_TLS_CA_FILE
  value: {{ $dir }}/ca.crt
{{- end }}
{{- end -}}

{{- define "spotrl.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "spotrl.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* (dict "root" $ "component" NAME); group-readable: the pod's fsGroup owns the files. */}}
{{- define "spotrl.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "spotrl.tlsSecret" . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end -}}

{{/* The checks of the security values, before anything renders. */}}
{{- define "spotrl.validateSecurity" -}}
{{- $s := .Values.security -}}
{{- $how := "docs/deploy-kubernetes.md, \"Least privilege\", makes it from the files of `spotrl secrets`" -}}
{{- if and (or $s.redisAcl $s.scopedTokens) (not $s.existingSecret) -}}
{{- fail (printf "security.existingSecret is required: a Secret of the Redis users and API tokens in namespace %s (%s), or turn security.redisAcl and security.scopedTokens off (values.yaml says what is then unprotected)" .Release.Namespace $how) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) (not (include "spotrl.certManager" .)) -}}
{{- fail (printf "tls.existingSecret is required: a Secret of ca.crt, tls.crt and tls.key in namespace %s (%s), or tls.certManager (cert-manager makes them), or set tls.enabled=false (every hop is then plain text)" .Release.Namespace $how) -}}
{{- end -}}
{{- if and (not $s.scopedTokens) (not (or .Values.auth.token .Values.auth.existingSecret)) -}}
{{- fail "auth.token or auth.existingSecret is required with security.scopedTokens=false: the services listen on the pod's address and refuse to without a token (e.g. --set auth.token=$(openssl rand -hex 24))" -}}
{{- end -}}
{{- if and $s.redisAcl (not .Values.redis.enabled) (contains "@" .Values.redis.url) -}}
{{- fail "redis.url is what rollout workers connect to with security.redisAcl: no credentials in it (each worker gets a Redis user of its own at registration); the coordinator's and trainer's URLs are in security.existingSecret" -}}
{{- end -}}
{{- end -}}
