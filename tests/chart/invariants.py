"""Rules every render of the chart must keep, as plain functions over the rendered objects: each
returns what breaks the rule (an empty list: nothing). They restate the rules from the outside
(the presets' labels and taints, the services' settings classes), never from the templates."""

from typing import Any

from services.coordinator.settings import CoordinatorSettings
from services.infra.settings import CommonSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.weightstore.settings import WeightStoreSettings

WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
SETTINGS: dict[str, type[CommonSettings]] = {
    "services.coordinator.main": CoordinatorSettings,
    "services.rollout.main": RolloutSettings,
    "services.trainer.main": TrainerSettings,
    "services.weightstore.main": WeightStoreSettings,
}
IMAGE_DEFAULT_HOST = "0.0.0.0"  # the Dockerfile's SPOTRL_HOST: a container without one binds it
HEALTHCHECK = ["python", "-m", "services.infra.healthcheck"]
DRAIN_MARGIN_S = 3.0  # after releasing, the worker still closes its engine and exits
# How long each platform lets an ordinary pod stop on a spot notice: GKE spot gives 15 s (its
# 30 s notice is split: 15 s for ordinary pods, then 15 s for system pods; up to 120 s on GKE
# 1.35+ through the node pool's system config), EC2 spot's interruption notice is 2 minutes
# (EKS managed node groups, Karpenter), an Azure spot eviction notice at least 30 s.
PRESET_GRACE_S = {"gke-spot": 15, "eks-spot": 120, "karpenter": 120, "aks-spot": 30}
# Each preset: the node labels a spot node of that platform carries, and the taints it has.
PRESETS: dict[str, tuple[dict[str, str], list[dict[str, str]]]] = {
    "gke-spot": (
        {"cloud.google.com/gke-spot": "true"},
        [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}],
    ),
    "eks-spot": ({"eks.amazonaws.com/capacityType": "SPOT"}, []),
    "karpenter": ({"karpenter.sh/capacity-type": "spot"}, []),
    "aks-spot": (
        {"kubernetes.azure.com/scalesetpriority": "spot"},
        [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}],
    ),
}
SPOT_LABELS = {key for labels, _ in PRESETS.values() for key in labels}


def name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against a pod's labels."""
    if not selector:
        return False  # an empty selector here is a mistake, never "everything"
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected(objs: list[dict], selector: dict) -> list[dict]:
    return [w for w in workloads(objs) if selects(selector, pod_labels(w))]


def container_ports(workload: dict) -> dict[Any, int]:
    """Each port of a pod by its name and by its number."""
    out: dict[Any, int] = {}
    for c in containers(workload):
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def spotrl_settings(container: dict) -> type[CommonSettings] | None:
    command = container.get("command", [])
    return SETTINGS.get(command[2]) if command[:2] == ["python", "-m"] else None


def tolerates(tolerations: list[dict], taint: dict[str, str]) -> bool:
    for t in tolerations:
        if t.get("effect") not in (None, "", taint["effect"]):
            continue
        if t.get("operator", "Equal") == "Exists":
            if t.get("key") in (None, "", taint["key"]):
                return True
        elif t.get("key") == taint["key"] and t.get("value") == taint["value"]:
            return True
    return False


def selector_problems(objs: list[dict]) -> list[str]:
    """Every selector (workload, Service, PDB, NetworkPolicy, autoscaler, monitor, ingress)
    matches the pods it is for, and a workload's selector no other workload's pods."""
    out = []
    for w in workloads(objs):
        sel = w["spec"]["selector"]
        if not selects(sel, pod_labels(w)):
            out.append(f"{name(w)}: its selector does not match its own pods")
        out += [
            f"{name(w)}: its selector also matches the pods of {name(other)}"
            for other in workloads(objs)
            if other is not w and selects(sel, pod_labels(other))
        ]
    for o in objs:
        kind = o["kind"]
        if kind == "Service":
            pods = selected(objs, {"matchLabels": o["spec"].get("selector", {})})
            if not pods:
                out.append(f"{name(o)}: selects no pod")
            for port in o["spec"]["ports"]:
                out += [
                    f"{name(o)}: no port {port['targetPort']!r} on {name(w)}"
                    for w in pods
                    if port["targetPort"] not in container_ports(w)
                ]
        elif kind == "PodDisruptionBudget":
            pods = selected(objs, o["spec"]["selector"])
            if not pods:
                out.append(f"{name(o)}: selects no pod")
            out += [
                f"{name(o)}: a budget on the preemptible pool {name(w)}"
                for w in pods
                if pod_labels(w).get("spotrl/pool-type") == "preemptible"
            ]
        elif kind == "NetworkPolicy":
            out += network_policy_problems(objs, o)
        elif kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            out += autoscaler_problems(objs, o)
        elif kind == "PodMonitor":
            pods = selected(objs, o["spec"]["selector"])
            if not pods:
                out.append(f"{name(o)}: selects no pod")
            out += [
                f"{name(o)}: no port {ep['port']!r} on {name(w)}"
                for ep in o["spec"]["podMetricsEndpoints"]
                for w in pods
                if ep["port"] not in container_ports(w)
            ]
        elif kind == "Ingress":
            services = {x["metadata"]["name"]: x for x in objs if x["kind"] == "Service"}
            for rule in o["spec"]["rules"]:
                for path in rule["http"]["paths"]:
                    svc = path["backend"]["service"]
                    ports = {
                        p.get("name")
                        for p in services.get(svc["name"], {"spec": {"ports": []}})["spec"]["ports"]
                    }
                    if svc["port"].get("name") not in ports:
                        out.append(f"{name(o)}: no Service {svc['name']} port {svc['port']}")
    return out


def network_policy_problems(objs: list[dict], policy: dict) -> list[str]:
    """It guards some pods, each of its peers is a pod of the release or another namespace, and
    every port those pods listen on is open to the release's own pods (peers, blocks, API)."""
    pods = selected(objs, policy["spec"]["podSelector"])
    if not pods:
        return [f"{name(policy)}: selects no pod"]
    out = []
    from_release: set[int] = set()
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        for peer in rule.get("from", []):
            if "podSelector" in peer and "namespaceSelector" not in peer:
                if not selected(objs, peer["podSelector"]):
                    out.append(f"{name(policy)}: a peer selects no pod")
                from_release |= ports
            elif not peer.get("namespaceSelector") and not peer.get("ipBlock"):
                out.append(f"{name(policy)}: a peer open to everything: {peer}")
    for w in pods:
        listening = {p for p in container_ports(w).values()}
        if listening - from_release:
            out.append(f"{name(policy)}: {name(w)} ports {sorted(listening - from_release)} closed")
    return out


def autoscaler_problems(objs: list[dict], scaler: dict) -> list[str]:
    """It scales a preemptible pool's Deployment, whose replicas the chart then leaves alone."""
    ref = scaler["spec"]["scaleTargetRef"]
    target = [
        o
        for o in workloads(objs)
        if o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"]
    ]
    if not target:
        return [f"{name(scaler)}: scales {ref['kind']}/{ref['name']}, which is not rendered"]
    out = []
    if pod_labels(target[0]).get("spotrl/pool-type") != "preemptible":
        out.append(f"{name(scaler)}: scales {name(target[0])}, not a preemptible pool")
    if "replicas" in target[0]["spec"]:
        out.append(f"{name(target[0])}: sets replicas while {name(scaler)} scales it")
    return out


def scrape_problems(objs: list[dict]) -> list[str]:
    """Where a PodMonitor or an autoscaler reads the services' /metrics and network policies
    guard them, each service's http port is open to some other namespace (Prometheus's)."""
    readers = {"PodMonitor", "ScaledObject", "HorizontalPodAutoscaler"}
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    if not policies or not readers & {o["kind"] for o in objs}:
        return []
    out = []
    for w in workloads(objs):
        http = container_ports(w).get("http")
        if http is None:
            continue
        open_to_others = any(
            http in {p["port"] for p in rule.get("ports", [])}
            and any("namespaceSelector" in peer for peer in rule.get("from", []))
            for policy in policies
            if selects(policy["spec"]["podSelector"], pod_labels(w))
            for rule in policy["spec"].get("ingress", [])
        )
        if not open_to_others:
            out.append(f"{name(w)}: /metrics (port {http}) closed to Prometheus")
    return out


def failover_problems(objs: list[dict], failover: bool) -> list[str]:
    """With a replica and Sentinel: two Redis nodes, each redis-server including the node file
    a container of its pod writes after asking Sentinel which node is the primary; Sentinels
    whose quorum is a majority of them; a worker's Redis URL names the Sentinels' Service (the
    other services' come from the Secret); the trainer waits for one replica. Without: one
    node, no Sentinel, no wait."""
    by_component = {pod_labels(w).get("app.kubernetes.io/component"): w for w in workloads(objs)}
    redis, sentinel = by_component.get("redis"), by_component.get("sentinel")
    out = []
    if redis is not None and redis["spec"]["replicas"] != (2 if failover else 1):
        out.append(f"{name(redis)}: {redis['spec']['replicas']} nodes with failover {failover}")
    if (sentinel is not None) != failover:
        out.append(f"Sentinel rendered: {sentinel is not None}, failover {failover}")
    if failover and redis is not None:
        server = next(c for c in containers(redis) if c["command"][0] == "redis-server")
        included = server["command"][server["command"].index("--include") + 1]
        node = [c for c in containers(redis) if included in " ".join(c["command"])]
        if not node or "get-master-addr-by-name" not in " ".join(node[0]["command"]):
            out.append(f"{name(redis)}: nothing asks Sentinel for the primary into {included}")
    if sentinel is not None:
        out += quorum_problems(sentinel)
    for w in workloads(objs):
        for c in containers(w):
            env = env_of(c)
            url = env.get("SPOTRL_REDIS_URL", {}).get("value")
            if url and failover and "+sentinel://" not in url:
                out.append(f"{name(w)}/{c['name']}: Redis at {url}, not through Sentinel")
            wait = env.get("SPOTRL_REDIS_WAIT_REPLICAS", {}).get("value")
            if spotrl_settings(c) is TrainerSettings and wait != ("1" if failover else "0"):
                out.append(f"{name(w)}/{c['name']}: waits for {wait} replicas")
    return out


def quorum_problems(sentinel: dict) -> list[str]:
    """Each Sentinel's configuration monitors the primary with a majority of them as quorum."""
    n = sentinel["spec"]["replicas"]
    for c in containers(sentinel):
        for line in " ".join(c.get("command", [])).splitlines():
            words = line.replace('"', " ").split()
            if words[1:3] == ["sentinel", "monitor"]:
                quorum = int(words[-1])
                return [] if n // 2 < quorum <= n else [f"{name(sentinel)}: quorum {quorum} of {n}"]
    return [f"{name(sentinel)}: monitors no primary"]
