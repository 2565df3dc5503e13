{{/*
Certificates: the Secrets the pods mount (the user's, or cert-manager's), cert-manager's objects
and the Redis pod's reloader. Every Python service re-reads its certificate files when they
change; a mounted Secret's files change in place (never a subPath mount: those never update).
*/}}

{{/* "true" when cert-manager makes the certificates (tls.certManager.enabled, or null: where
cert-manager.io/v1 is installed and no tls.existingSecret is named). */}}
{{- define "spotrl.certManager" -}}
{{- $t := .Values.tls -}}
{{- $cm := $t.certManager -}}
{{- if $t.enabled -}}
{{- if kindIs "invalid" $cm.enabled -}}
{{- if and (.Capabilities.APIVersions.Has "cert-manager.io/v1") (not $t.existingSecret) }}true{{ end -}}
{{- else if $cm.enabled }}true{{ end -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.validateCerts" -}}
{{- $cm := .Values.tls.certManager -}}
{{- if include "spotrl.certManager" . -}}
{{- if not (or $cm.caSecret $cm.issuerRef.name) -}}
{{- fail "tls.certManager: set tls.certManager.caSecret (a kubernetes.io/tls Secret of the CA: ca/ca.crt and ca/ca.key of `spotrl secrets --tls`) or tls.certManager.issuerRef (an Issuer of yours)" -}}
{{- end -}}
{{- if and $cm.caSecret $cm.issuerRef.name -}}
{{- fail "tls.certManager: caSecret or issuerRef, not both" -}}
{{- end -}}
{{- if and .Values.tls.existingSecret (eq (toString $cm.enabled) "true") -}}
{{- fail "tls.existingSecret names your certificate while tls.certManager.enabled makes them: set one" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Secret of the services' certificate, and of the rollout pools'. */}}
{{- define "spotrl.serverTlsSecret" -}}
{{- if include "spotrl.certManager" . -}}
{{- printf "%s-tls" (include "spotrl.fullname" .) -}}
{{- else -}}
{{- .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "spotrl.rolloutTlsSecret" -}}
{{- if include "spotrl.certManager" . -}}
{{- printf "%s-tls-rollout" (include "spotrl.fullname" .) -}}
{{- else -}}
{{- .Values.tls.rolloutSecret | default .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* The names the services' certificate carries: each Service (short and in-namespace) and
the probes' localhost. */}}
{{- define "spotrl.serverDnsNames" -}}
{{- $full := include "spotrl.fullname" . -}}
{{- range $c := list "coordinator" "weightstore" "trainer" "redis" }}
- {{ $full }}-{{ $c }}
- {{ $full }}-{{ $c }}.{{ $.Release.Namespace }}.svc
{{- end }}
{{- if include "spotrl.failover" . }}
{{- /* the Sentinels, and each node and Sentinel by the name Sentinel announces it by */}}
- {{ $full }}-sentinel
- {{ $full }}-sentinel.{{ $.Release.Namespace }}.svc
- "*.{{ $full }}-redis"
- "*.{{ $full }}-sentinel"
{{- end }}
- localhost
{{- end -}}

{{/* The Redis pod's reloader: Redis reads its TLS files at start only; CONFIG SET of the same
paths makes it read them again. (dict "root" $ "ping" LIST) */}}
{{- define "spotrl.redisReloader" -}}
{{- $root := .root -}}
{{- $dir := include "spotrl.tlsDir" $root -}}
{{- $files := printf "%s/tls.crt %s/tls.key %s/ca.crt" $dir $dir $dir -}}
{{- $cli := join " " .ping -}}
{{- if $root.Values.security.redisAcl }}{{ $cli = printf "%s --user spotrl-certs" $cli }}{{ end -}}
- name: tls-reloader
  image: {{ include "spotrl.image" (dict "root" $root "image" $root.Values.redis.image) }}
  imagePullPolicy: {{ $root.Values.redis.image.pullPolicy }}
  command:
    - sh
    - -c
    - |
      sum() { cat {{ $files }} | md5sum; }
      last=$(sum)
      while sleep {{ $root.Values.tls.reloadIntervalS }}; do
        now=$(sum)
        [ "$now" = "$last" ] && continue
        if {{ $cli }} CONFIG SET tls-cert-file {{ $dir }}/tls.crt tls-key-file {{ $dir }}/tls.key tls-ca-cert-file {{ $dir }}/ca.crt | grep -q OK; then
          last=$now
          echo "tls-reloader: Redis reloaded its certificate"
        else
          echo "tls-reloader: CONFIG SET refused; trying again" >&2
        fi
      done
  {{- if $root.Values.security.redisAcl }}
  env:
    - name: REDISCLI_AUTH  # the spotrl-certs user: PING and CONFIG SET only
      valueFrom:
        secretKeyRef:
          name: {{ $root.Values.security.existingSecret }}
          key: redis-password-certs
  {{- end }}
  securityContext:
    {{- include "spotrl.containerSecurityContext" $root | nindent 4 }}
  resources:
    requests: {cpu: 5m, memory: 16Mi}
    limits: {cpu: 100m, memory: 64Mi}
  volumeMounts:
    - name: tls
      mountPath: {{ $dir }}
      readOnly: true
{{- end -}}
