"""Rules a render must keep to run on a real cluster (issue 48), as plain functions over the
rendered objects: each returns what breaks the rule (empty: nothing). The platforms' figures and
the stock selectors are restated here from their documentation, never read from the templates.

What they cover: the reserved side never on a spot preset's node, ReadWriteOnce claims mounted
on one node only, budgets that let `kubectl drain` evict, Redis's memory headroom for a
rewrite's fork, TLS files that update in place, cert-manager's lifetimes, what a monitor must
carry to be read, the ingress class and the controller the network policy admits, and the
environment sandbox's system calls."""

import re
from typing import Any

from tests.chart.invariants import (
    PRESETS,
    containers,
    env_of,
    name,
    pod_labels,
    pod_spec,
    selects,
    tolerates,
    workloads,
)

HOSTNAME = "kubernetes.io/hostname"
SHARED_MODES = {"ReadWriteMany", "ReadOnlyMany"}
TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}
REDIS_HEADROOM = 0.5  # an AOF rewrite forks: copy-on-write may double the data's pages
# kube-prometheus-stack's Prometheus selects monitors by the label release: <its release name>.
STOCK_MONITOR_SELECTOR = "release"
INGRESS_CONTROLLER_NAMESPACES = {"nginx": "ingress-nginx"}  # ingress-nginx's own chart


def match_expression(expr: dict, labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    return {
        "In": lambda: labels.get(key) in values,
        "NotIn": lambda: labels.get(key) not in values,
        "Exists": lambda: key in labels,
        "DoesNotExist": lambda: key not in labels,
    }[op]()


def schedulable_on(spec: dict, node_labels: dict[str, str], taints: list[dict]) -> bool:
    """Whether the scheduler may put a pod of this spec on a node with these labels and taints
    (nodeSelector, required node affinity, NoSchedule taints)."""
    if any(node_labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if required and not any(
        all(match_expression(e, node_labels) for e in term.get("matchExpressions", []))
        for term in required["nodeSelectorTerms"]
    ):
        return False
    return all(tolerates(spec.get("tolerations", []), t) for t in taints)


def spot_placement_problems(objs: list[dict]) -> list[str]:
    """No reserved workload may schedule onto a node carrying a spot preset's labels, even when
    that spot pool has no taint (the documented GKE and EKS pools have none)."""
    return [
        f"{name(w)}: may schedule onto a {preset} node ({labels})"
        for w in workloads(objs)
        if pod_labels(w).get("spotrl/pool-type") != "preemptible"
        for preset, (labels, _) in PRESETS.items()
        if schedulable_on(pod_spec(w), labels, [])
    ]


def _claims(objs: list[dict]) -> dict[str, list[str]]:
    return {
        o["metadata"]["name"]: o["spec"]["accessModes"]
        for o in objs
        if o["kind"] == "PersistentVolumeClaim"
    }


def _mounted_claims(workload: dict) -> set[str]:
    return {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod_spec(workload).get("volumes", [])
        if "persistentVolumeClaim" in v
    }


def _keeps_with(workload: dict, others: list[dict]) -> bool:
    """A required pod affinity on the node's hostname selecting every pod in `others`."""
    terms = (
        pod_spec(workload)
        .get("affinity", {})
        .get("podAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", [])
    )
    return any(
        t.get("topologyKey") == HOSTNAME
        and all(selects(t.get("labelSelector", {}), pod_labels(o)) for o in others)
        for t in terms
    )


def rwo_problems(objs: list[dict]) -> list[str]:
    """A ReadWriteOnce claim attaches to one node: it is mounted by one pod at a time (one
    replica, Recreate), or every pod mounting it must share the node of the others (a required
    pod affinity on the hostname selecting all of them, its own included)."""
    out = []
    for claim, modes in _claims(objs).items():
        if SHARED_MODES & set(modes):
            continue
        users = [w for w in workloads(objs) if claim in _mounted_claims(w)]
        if len(users) == 1:
            (w,) = users
            if w["spec"].get("replicas", 1) > 1:
                out.append(f"{name(w)}: {w['spec']['replicas']} replicas on ReadWriteOnce {claim}")
            if (
                w["kind"] == "Deployment"
                and w["spec"].get("strategy", {}).get("type") != "Recreate"
            ):
                out.append(f"{name(w)}: a rolling update mounts ReadWriteOnce {claim} twice")
        elif len(users) > 1:
            out += [
                f"{name(w)}: mounts ReadWriteOnce {claim} with no pod affinity to "
                f"{[name(o) for o in users if o is not w]} (Multi-Attach on two nodes)"
                for w in users
                if not _keeps_with(w, users)
            ]
    return out


def pdb_problems(objs: list[dict]) -> list[str]:
    """No budget allows zero disruptions: `kubectl drain` must be able to evict every pod."""
    out = []
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        spec = pdb["spec"]
        replicas = sum(
            w["spec"].get("replicas", 1)
            for w in workloads(objs)
            if selects(spec["selector"], pod_labels(w))
        )
        if "maxUnavailable" in spec:
            allowed = _count(spec["maxUnavailable"], replicas)
        else:
            allowed = replicas - _count(spec.get("minAvailable", 0), replicas, up=True)
        if allowed < 1:
            out.append(f"{name(pdb)}: allows {allowed} disruptions of {replicas} pod(s)")
    return out


def _count(value: Any, total: int, up: bool = False) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total
        return -(-share // 100) if up else share // 100
    return int(value)


UNITS = {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
QUANTITY = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "K": 1000, "M": 1000**2, "G": 1000**3}


def _bytes(text: str, units: dict[str, int]) -> int:
    found = re.fullmatch(r"(\d+)([A-Za-z]*)", text)
    assert found and found.group(2) in {**units, "": 1}, f"not a size: {text}"
    return int(found.group(1)) * units.get(found.group(2), 1)


def redis_memory_problems(objs: list[dict]) -> list[str]:
    """Redis's maxmemory is at most half its container's memory limit: an AOF rewrite forks, and
    the child's copy-on-write pages count against the same limit."""
    out = []
    for w in workloads(objs):
        for c in containers(w):
            command = c.get("command", [])
            if not command or command[0] != "redis-server" or "--maxmemory" not in command:
                continue
            raw = command[command.index("--maxmemory") + 1].lower()
            maxmemory = _bytes(raw, UNITS)
            limit_raw = str(c["resources"]["limits"]["memory"])
            limit = _bytes(limit_raw, QUANTITY)
            if maxmemory > REDIS_HEADROOM * limit:
                out.append(
                    f"{name(w)}/{c['name']}: maxmemory {raw} over half the {limit_raw} limit "
                    "(no room for an AOF rewrite's fork)"
                )
    return out


def subpath_problems(objs: list[dict]) -> list[str]:
    """A Secret holding TLS files is never mounted by subPath: such a mount never updates, so a
    renewed certificate would never reach the process."""
    out = []
    for w in workloads(objs):
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        for c in containers(w):
            for m in c.get("volumeMounts", []):
                secret = volumes.get(m["name"], {}).get("secret")
                keys = {i["key"] for i in (secret or {}).get("items", [])}
                if secret and (keys & TLS_KEYS or not keys) and "subPath" in m:
                    out.append(f"{name(w)}/{c['name']}: {m['name']} by subPath never updates")
    return out


def go_duration_s(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"not a duration: {text}"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def certificate_problems(objs: list[dict], duration: str, renew_before: str) -> list[str]:
    """Each Certificate lives what the values say, is renewed before it expires, and every TLS
    Secret a pod mounts is one a Certificate writes."""
    certs = [o for o in objs if o["kind"] == "Certificate"]
    out = []
    for cert in certs:
        spec = cert["spec"]
        if spec.get("duration") != duration:
            out.append(f"{name(cert)}: duration {spec.get('duration')}, the values say {duration}")
        if spec.get("renewBefore") != renew_before:
            out.append(f"{name(cert)}: renewBefore {spec.get('renewBefore')}, not {renew_before}")
        if go_duration_s(spec.get("renewBefore", "0s")) >= go_duration_s(spec["duration"]):
            out.append(f"{name(cert)}: renewBefore is not under its duration: never valid long")
    written = {c["spec"]["secretName"] for c in certs}
    for w in workloads(objs):
        for v in pod_spec(w).get("volumes", []):
            s = v.get("secret")
            keys = {i["key"] for i in (s or {}).get("items", [])}
            if s and keys >= TLS_KEYS and s["secretName"] not in written:
                out.append(f"{name(w)}: mounts {s['secretName']}, which no Certificate writes")
    return out


def scrape_target_problems(objs: list[dict], release: str, elsewhere: bool = False) -> list[str]:
    """With an autoscaler, some monitor selects the coordinator's pods on their http port (unless
    the values say a scrape config of the user's does); a PodMonitor carries the release label
    the stock kube-prometheus-stack selects by."""
    monitors = [o for o in objs if o["kind"] in ("PodMonitor", "PodMonitoring")]
    out = []
    for m in (m for m in monitors if m["kind"] == "PodMonitor" and release):
        if m["metadata"].get("labels", {}).get(STOCK_MONITOR_SELECTOR) != release:
            out.append(f"{name(m)}: no label release={release}: kube-prometheus-stack skips it")
    if elsewhere or not any(o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler") for o in objs):
        return out
    coordinator = [
        w
        for w in workloads(objs)
        if pod_labels(w).get("app.kubernetes.io/component") == "coordinator"
    ]
    scraped = any(
        selects(m["spec"]["selector"], pod_labels(w))
        and any(
            ep.get("port") == "http"
            for ep in m["spec"].get("podMetricsEndpoints", m["spec"].get("endpoints", []))
        )
        for m in monitors
        for w in coordinator
    )
    if not scraped:
        out.append("an autoscaler reads the coordinator's gauges, and no monitor scrapes them")
    return out


def ingress_problems(objs: list[dict]) -> list[str]:
    """An Ingress names its class; where that class's controller namespace is known, the
    coordinator's NetworkPolicy admits it; the nginx-only HTTPS annotation only on nginx."""
    out = []
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    for ing in (o for o in objs if o["kind"] == "Ingress"):
        cls = ing["spec"].get("ingressClassName")
        if not cls:
            out.append(f"{name(ing)}: no ingressClassName (the cluster's default class decides)")
        annotations = ing["metadata"].get("annotations", {})
        if cls != "nginx" and any(k.startswith("nginx.ingress") for k in annotations):
            out.append(f"{name(ing)}: nginx annotations on class {cls}")
        namespace = INGRESS_CONTROLLER_NAMESPACES.get(cls)
        admitted = {
            peer.get("namespaceSelector", {})
            .get("matchLabels", {})
            .get("kubernetes.io/metadata.name")
            for p in policies
            if p["metadata"]["name"].endswith("-coordinator")
            for rule in p["spec"].get("ingress", [])
            for peer in rule.get("from", [])
        }
        if policies and namespace and namespace not in admitted:
            out.append(f"{name(ing)}: class {cls}'s controller ({namespace}) is not admitted")
    return out


def sandbox_problems(objs: list[dict]) -> list[str]:
    """Where environments are isolated (SPOTRL_ENVIRONMENT_NETWORK false, the setting's default),
    the coordinator's container may call unshare(2): RuntimeDefault's seccomp profile refuses it
    to a process without CAP_SYS_ADMIN."""
    out = []
    for w in workloads(objs):
        for c in containers(w):
            if c.get("command", [])[2:3] != ["services.coordinator.main"]:
                continue
            isolated = env_of(c).get("SPOTRL_ENVIRONMENT_NETWORK", {}).get("value") != "true"
            seccomp = c.get("securityContext", {}).get("seccompProfile") or pod_spec(w).get(
                "securityContext", {}
            ).get("seccompProfile", {})
            if isolated and seccomp.get("type") == "RuntimeDefault":
                out.append(
                    f"{name(w)}/{c['name']}: environments isolated under RuntimeDefault seccomp: "
                    "unshare(CLONE_NEWUSER|CLONE_NEWNET) is refused, every environment fails"
                )
    return out
