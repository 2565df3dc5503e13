{{/*
Where a rollout pool runs. A spot preset gives its cloud's node selector and toleration, and
maxGraceSeconds: how long its platform lets a pod stop on a spot notice (GKE spot: 15 s for
ordinary pods, the rest of its 30 s going to system pods; EKS and Karpenter: the 2-minute
interruption notice, 120 s; AKS: the 30 s eviction notice). A reserved pool without preset runs
where the reserved side does. The pool's own nodeSelector wins key by key, its tolerations are
added.
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
  maxGraceSeconds: 15
eks-spot:
  nodeSelector:
    eks.amazonaws.com/capacityType: SPOT
  tolerations: []
  maxGraceSeconds: 120
karpenter:
  nodeSelector:
    karpenter.sh/capacity-type: spot
  tolerations: []
  maxGraceSeconds: 120
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

{{/* The reserved side's affinity: (dict "root" $ "affinity" MAP) with (reserved.avoidSpot)
every preset's spot label required absent or other than the spot value, in each of its required
terms. MAP: reserved.affinity, or a reserved pool's own. */}}
{{- define "spotrl.reservedAffinity" -}}
{{- $affinity := deepCopy (.affinity | default dict) -}}
{{- if .root.Values.reserved.avoidSpot -}}
{{- $avoid := list -}}
{{- range $preset, $p := include "spotrl.presets" .root | fromYaml -}}
{{- range $key, $value := $p.nodeSelector -}}
{{- $avoid = append $avoid (dict "key" $key "operator" "NotIn" "values" (list $value)) -}}
{{- end -}}
{{- end -}}
{{- $node := $affinity.nodeAffinity | default dict -}}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := list -}}
{{- range ($required.nodeSelectorTerms | default (list dict)) -}}
{{- $term := deepCopy . -}}
{{- $_ := set $term "matchExpressions" (concat ($term.matchExpressions | default list) $avoid) -}}
{{- $terms = append $terms $term -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- toYaml $affinity -}}
{{- end -}}

{{/* A pool with the defaults filled in: (dict "root" $ "pool" POOL) -> YAML */}}
{{- define "spotrl.pool" -}}
{{- $pool := deepCopy .pool -}}
{{- range $key, $value := .root.Values.rollout.defaults -}}
{{- if and (not (hasKey $pool $key)) (not (kindIs "invalid" $value)) -}}
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
{{- if eq $pool.type "reserved" -}}
{{- $affinity = include "spotrl.reservedAffinity" (dict "root" .root "affinity" $affinity) | fromYaml -}}
{{- end -}}
{{- if kindIs "invalid" $pool.preemptGraceS -}}
{{- $budget := $preset.maxGraceSeconds | default 25 -}}
{{- if le (int $budget) (int $pool.graceMarginS) -}}
{{- fail (printf "rollout pool %q: graceMarginS %d s leaves no drain time in the %d s a %s node gives a pod" $pool.name (int $pool.graceMarginS) (int $budget) $pool.preset) -}}
{{- end -}}
{{- $_ := set $pool "preemptGraceS" (sub (int $budget) (int $pool.graceMarginS)) -}}
{{- end -}}
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
