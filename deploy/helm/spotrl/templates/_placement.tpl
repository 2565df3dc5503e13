{{/*
Where a rollout pool runs. A spot preset gives its cloud's node selector and toleration (and the
longest grace period its platform gives a pod); a reserved pool without preset runs where the
reserved side does. The pool's own nodeSelector wins key by key, its tolerations are added.
*/}}

{{- define "spotrl.presets" -}}
gke-spot:
  nodeSelector:
    cloud.google.com/gke-spot: "true"
  tolerations:
    - key: cloud.google.com/gke-spot
      operator: Equal
      value: "true"
      effect: NoSchedule
  maxGraceSeconds: 30
eks-spot:
  nodeSelector:
    eks.amazonaws.com/capacityType: SPOT
  tolerations: []
  maxGraceSeconds: 30
karpenter:
  nodeSelector:
    karpenter.sh/capacity-type: spot
  tolerations: []
  maxGraceSeconds: 30
aks-spot:
  nodeSelector:
    kubernetes.azure.com/scalesetpriority: spot
  tolerations:
    - key: kubernetes.azure.com/scalesetpriority
      operator: Equal
      value: spot
      effect: NoSchedule
  maxGraceSeconds: 30
none:
  nodeSelector: {}
  tolerations: []
{{- end -}}

{{/* A pool with the defaults filled in: (dict "root" $ "pool" POOL) -> YAML */}}
{{- define "spotrl.pool" -}}
{{- $pool := deepCopy .pool -}}
{{- range $key, $value := .root.Values.rollout.defaults -}}
{{- if not (hasKey $pool $key) -}}
{{- $_ := set $pool $key (deepCopy $value) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $pool "preset" ($pool.preset | default "none") -}}
{{- $presets := include "spotrl.presets" . | fromYaml -}}
{{- $preset := get $presets $pool.preset -}}
{{- if and (eq $pool.type "reserved") (ne $pool.preset "none") -}}
{{- fail (printf "rollout pool %q is reserved: a spot preset (%s) would put it on preemptible nodes" $pool.name $pool.preset) -}}
{{- end -}}
{{- $base := $preset -}}
{{- if eq $pool.type "reserved" -}}
{{- $base = dict "nodeSelector" .root.Values.reserved.nodeSelector "tolerations" .root.Values.reserved.tolerations "affinity" .root.Values.reserved.affinity -}}
{{- end -}}
{{- $nodeSelector := merge (deepCopy ($pool.nodeSelector | default dict)) (deepCopy ($base.nodeSelector | default dict)) -}}
{{- $tolerations := concat ($base.tolerations | default list) ($pool.tolerations | default list) -}}
{{- if and .root.Values.gpu.enabled (gt (int $pool.gpus) 0) -}}
{{- $tolerations = concat $tolerations .root.Values.gpu.tolerations -}}
{{- end -}}
{{- $affinity := $pool.affinity | default ($base.affinity | default dict) -}}
{{- $grace := add (int (ceil $pool.preemptGraceS)) (int $pool.graceMarginS) -}}
{{- if and $preset.maxGraceSeconds (gt (int $grace) (int $preset.maxGraceSeconds)) -}}
{{- fail (printf "rollout pool %q: preemptGraceS + graceMarginS = %d s, over the %d s a %s node gives a pod" $pool.name (int $grace) (int $preset.maxGraceSeconds) $pool.preset) -}}
{{- end -}}
{{- $_ := set $pool "nodeSelector" $nodeSelector -}}
{{- $_ := set $pool "tolerations" $tolerations -}}
{{- $_ := set $pool "affinity" $affinity -}}
{{- $_ := set $pool "terminationGracePeriodSeconds" $grace -}}
{{- toYaml $pool -}}
{{- end -}}
