{{/*
A Redis replica and Sentinel (redis.replica.enabled with redis.sentinel.enabled; docs/reliability.md,
"Redis failover"). The Redis StatefulSet runs two nodes; before redis-server starts, its pod's
`node` container asks Sentinel which node is the primary and writes /tmp/node.conf (redis-server
--include's it): replicate from that one, or, when no Sentinel answers (the first start), node 0
is the primary and node 1 its replica. Each node is announced by its pod's name under the
headless Service, which Sentinel reports to the services (redis+sentinel://).
*/}}

{{/* "true" when the chart runs a replica and Sentinel */}}
{{- define "spotrl.failover" -}}
{{- if and .Values.redis.enabled .Values.redis.replica.enabled .Values.redis.sentinel.enabled }}true{{ end -}}
{{- end -}}

{{- define "spotrl.validateFailover" -}}
{{- $r := .Values.redis -}}
{{- if ne (toString $r.replica.enabled) (toString $r.sentinel.enabled) -}}
{{- fail "redis.replica.enabled and redis.sentinel.enabled go together: Sentinel promotes the replica" -}}
{{- end -}}
{{- if and $r.sentinel.enabled (not $r.enabled) -}}
{{- fail "redis.sentinel.enabled runs a replica of the chart's Redis: a managed Redis (redis.enabled=false) brings its own failover" -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.sentinelPort" -}}26379{{- end -}}

{{/* Sentinel's name of the primary, in every URL and script */}}
{{- define "spotrl.sentinelService" -}}spotrl{{- end -}}

{{/* What the services connect to: the Sentinels, which name the primary. */}}
{{- define "spotrl.sentinelUrl" -}}
{{- $scheme := ternary "rediss+sentinel" "redis+sentinel" .Values.tls.enabled -}}
{{- printf "%s://%s-sentinel:%s/%s/0" $scheme (include "spotrl.fullname" .) (include "spotrl.sentinelPort" .) (include "spotrl.sentinelService" .) -}}
{{- end -}}

{{/* A Redis node's name as Sentinel announces it: (dict "root" $ "pod" POD) */}}
{{- define "spotrl.redisNode" -}}
{{- $full := include "spotrl.fullname" .root -}}
{{- printf "%s.%s-redis" .pod $full -}}
{{- end -}}

{{/* redis-cli's TLS flags (none without TLS) */}}
{{- define "spotrl.cliTls" -}}
{{- if .Values.tls.enabled }}--tls --cacert {{ include "spotrl.tlsDir" . }}/ca.crt{{ end -}}
{{- end -}}

{{/* The Redis pod's `node` container: which node to replicate from, asked of Sentinel. */}}
{{- define "spotrl.redisNodeContainer" -}}
{{- $root := . -}}
{{- $full := include "spotrl.fullname" . -}}
{{- $ports := include "spotrl.ports" . | fromYaml -}}
- name: node
  image: {{ include "spotrl.image" (dict "root" $root "image" .Values.redis.image) }}
  imagePullPolicy: {{ .Values.redis.image.pullPolicy }}
  command:
    - sh
    - -ec
    - |
      self="$POD_NAME.{{ $full }}-redis"
      first={{ include "spotrl.redisNode" (dict "root" $root "pod" (printf "%s-redis-0" $full)) }}
      primary=$(redis-cli {{ include "spotrl.cliTls" $root }} -h {{ $full }}-sentinel -p {{ include "spotrl.sentinelPort" $root }} --raw \
        SENTINEL get-master-addr-by-name {{ include "spotrl.sentinelService" $root }} 2>/dev/null | head -n 1 || true)
      if [ -z "$primary" ] && [ "$self" != "$first" ]; then primary=$first; fi
      umask 077
      {
        echo "replica-announce-ip $self"
        if [ -n "${SPOTRL_REPLICA_REDIS_AUTH:-}" ]; then
          echo "masteruser spotrl-replica"
          echo "masterauth $SPOTRL_REPLICA_REDIS_AUTH"
        fi
        {{- if .Values.tls.enabled }}
        echo "tls-replication yes"
        {{- end }}
        if [ -n "$primary" ] && [ "$primary" != "$self" ]; then
          echo "replicaof $primary {{ $ports.redis }}"
        fi
      } > /tmp/node.conf
      echo "node $self: primary ${primary:-itself}"
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if .Values.security.redisAcl }}
    - name: SPOTRL_REPLICA_REDIS_AUTH  # what it logs in to its primary as (PSYNC, REPLCONF, PING)
      valueFrom:
        secretKeyRef:
          name: {{ .Values.security.existingSecret }}
          key: redis-password-replica
    {{- end }}
  securityContext:
    {{- include "spotrl.containerSecurityContext" . | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {cpu: 100m, memory: 64Mi}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    {{- with include "spotrl.tlsMount" . | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}
