{{/*
The autoscaler's reading of the coordinator's gauges, shared by KEDA's query and the
prometheus-adapter rule the NOTES print for the HPA mode, so the two modes agree.
*/}}

{{/* The number of preemptible pools (K): each autoscaled pool holds 1/K of the figure. */}}
{{- define "spotrl.spotPoolCount" -}}
{{- $k := 0 -}}
{{- range .Values.rollout.pools }}{{ if eq .type "preemptible" }}{{ $k = add1 $k }}{{ end }}{{ end -}}
{{- $k -}}
{{- end -}}

{{/* The lowest replica count: autoscaling.minReplicas, else 0 with KEDA (scale to zero) and 1
with the HPA (an HPA cannot go below 1). */}}
{{- define "spotrl.minReplicas" -}}
{{- $a := .Values.autoscaling -}}
{{- $min := ternary 1 0 (eq $a.mode "hpa") -}}
{{- if not (kindIs "invalid" $a.minReplicas) }}{{ $min = int $a.minReplicas }}{{ end -}}
{{- $min -}}
{{- end -}}

{{/* The query: (dict "root" $ "matchers" "LABEL MATCHERS"). A figure (wanted > 0, a run
active) -> the figure; a run active without a figure -> maxReplicas x K; no run -> 0; no gauge
-> no sample. */}}
{{- define "spotrl.scaleQuery" -}}
{{- $wanted := printf "max(spotrl_coordinator_preemptible_wanted{%s})" .matchers -}}
{{- $active := printf "max(spotrl_coordinator_runs_active{%s})" .matchers -}}
{{- $all := mul (int .root.Values.autoscaling.maxReplicas) (int (include "spotrl.spotPoolCount" .root)) -}}
{{- printf "((%s > 0) and (%s > 0)) or (clamp_max(%s, 1) * %d)" $wanted $active $active $all -}}
{{- end -}}

{{/* prometheus-adapter's external rule (its values' rules.external) for the HPA mode. */}}
{{- define "spotrl.adapterRule" -}}
{{- $m := "<<.LabelMatchers>>, container=\"coordinator\"" -}}
- seriesQuery: 'spotrl_coordinator_runs_active{namespace!="",container="coordinator"}'
  resources:
    overrides:
      namespace: {resource: namespace}
  name:
    as: {{ .Values.autoscaling.hpa.metricName }}
  metricsQuery: '{{ include "spotrl.scaleQuery" (dict "root" . "matchers" $m) }}'
{{- end -}}

{{/* Autoscaling reads a gauge some Prometheus must scrape: refuse a release where none does. */}}
{{- define "spotrl.validateAutoscaling" -}}
{{- $a := .Values.autoscaling -}}
{{- $mon := .Values.monitoring -}}
{{- if $a.enabled -}}
{{- if and (eq $a.mode "hpa") (lt (int (include "spotrl.minReplicas" .)) 1) -}}
{{- fail "autoscaling.mode=hpa: minReplicas must be at least 1 (an HPA does not scale to zero)" -}}
{{- end -}}
{{- if gt (int (include "spotrl.minReplicas" .)) (int $a.maxReplicas) -}}
{{- fail "autoscaling.minReplicas is over autoscaling.maxReplicas" -}}
{{- end -}}
{{- if not (or $mon.podMonitor.enabled $mon.podMonitoring.enabled $mon.scrapedElsewhere) -}}
{{- fail "autoscaling.enabled reads the coordinator's gauges from Prometheus, and nothing here makes Prometheus scrape them: the query would be empty forever. Set monitoring.podMonitor.enabled=true (prometheus-operator; with kube-prometheus-stack also monitoring.prometheusRelease=<its release name>) or monitoring.podMonitoring.enabled=true (GKE Managed Prometheus), or monitoring.scrapedElsewhere=true if your own scrape config reads the coordinator's /metrics" -}}
{{- end -}}
{{- end -}}
{{- end -}}
