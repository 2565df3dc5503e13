{{/*
Settings combinations that would fail on a cluster, refused at render with the reason.
*/}}

{{/* The namespace of the ingress controller the NetworkPolicy lets reach the API. */}}
{{- define "spotrl.ingressNamespace" -}}
{{- $i := .Values.ingress -}}
{{- if .Values.networkPolicy.ingressControllerNamespace -}}
{{- .Values.networkPolicy.ingressControllerNamespace -}}
{{- else if eq $i.className "nginx" -}}
ingress-nginx
{{- end -}}
{{- end -}}

{{- define "spotrl.validatePlatform" -}}
{{- $i := .Values.ingress -}}
{{- if and $i.enabled (eq $i.className "gce") -}}
{{- fail "ingress.className=gce is refused: GKE's load balancer needs the coordinator's Service as a NEG with a BackendConfig health check over HTTPS on /healthz, and its health checkers' ranges (35.191.0.0/16, 130.211.0.0/22) let through the NetworkPolicy; the chart makes none of these. Install ingress-nginx (ingress.className=nginx) or use kubectl port-forward (docs/deploy-kubernetes.md, \"The dashboard from outside\")" -}}
{{- end -}}
{{- if and $i.enabled .Values.networkPolicy.enabled (not (include "spotrl.ingressNamespace" .)) -}}
{{- fail (printf "ingress.className=%s: set networkPolicy.ingressControllerNamespace to the namespace of that class's controller (the NetworkPolicy lets it reach the coordinator)" $i.className) -}}
{{- end -}}
{{- if hasKey .Values.coordinator.settings "environment_network" -}}
{{- fail "coordinator.settings.environment_network is set by coordinator.environments.network (open or isolated): the chart grants what isolation needs" -}}
{{- end -}}
{{- include "spotrl.validateCerts" . -}}
{{- end -}}
