"""Rules on the pods of a render: where spot pools run, how long a preempted worker is given,
the token off loopback, requests and limits, pinned images, real settings, security, probes.
Each returns what breaks the rule (empty: nothing)."""

import re
from typing import Any

from pydantic import ValidationError

from services.infra.scopes import accept_list
from services.infra.settings import is_loopback
from services.rollout.settings import RolloutSettings
from tests.chart.invariants import (
    DRAIN_MARGIN_S,
    HEALTHCHECK,
    IMAGE_DEFAULT_HOST,
    PRESET_GRACE_S,
    PRESETS,
    SPOT_LABELS,
    container_ports,
    containers,
    env_of,
    name,
    pod_labels,
    pod_spec,
    spotrl_settings,
    tolerates,
    workloads,
)

POD_IP = "192.0.2.10"  # what status.podIP stands for when a settings class reads the env
ACCEPTING = ("SPOTRL_API_TOKEN", "SPOTRL_ACCEPT_TOKENS")  # the settings that switch auth on
# What the security Secret's keys stand for when a settings class reads the env: one token per
# scope, the accept lists of their digests, Redis URLs with a role's user.
TEST_TOKENS = {
    scope: f"chart-test-{scope}-token" for scope in ("admin", "worker", "trainer", "read")
}


def secret_stand_in(secret: str, key: str) -> str:
    if key.endswith("-token") and key.removesuffix("-token") in TEST_TOKENS:
        return TEST_TOKENS[key.removesuffix("-token")]
    if key.startswith("accept-"):
        return accept_list(TEST_TOKENS)
    if key.startswith("redis-url-"):
        return f"rediss://spotrl-{key.removeprefix('redis-url-')}:pw@spotrl-redis:6379/0"
    return f"secret:{secret}/{key}"


def pool_workload(objs: list[dict], pool: str) -> dict:
    found = [w for w in workloads(objs) if pod_labels(w).get("spotrl/pool") == pool]
    assert len(found) == 1, f"one Deployment for rollout pool {pool}, found {len(found)}"
    return found[0]


def spot_problems(objs: list[dict], pools: list[dict[str, Any]]) -> list[str]:
    """A pool with a preset carries its node labels and tolerates its taints, and keeps its own
    selector and tolerations; a pool without one never lands on a spot label by accident."""
    out = []
    for pool in pools:
        w = pool_workload(objs, pool["name"])
        spec = pod_spec(w)
        selector, tolerations = spec.get("nodeSelector", {}), spec.get("tolerations", [])
        labels, taints = PRESETS.get(pool.get("preset", "none"), ({}, []))
        for key, value in {**labels, **pool.get("nodeSelector", {})}.items():
            if selector.get(key) != value:
                out.append(f"{name(w)}: nodeSelector {key}={selector.get(key)!r}, want {value!r}")
        for taint in taints + [
            {"key": t["key"], "value": t.get("value", ""), "effect": t["effect"]}
            for t in pool.get("tolerations", [])
        ]:
            if not tolerates(tolerations, taint):
                out.append(f"{name(w)}: does not tolerate {taint}")
        if not labels and SPOT_LABELS & set(selector):
            out.append(f"{name(w)}: no preset, yet on spot nodes: {selector}")
    return out


def reserved_problems(objs: list[dict], reserved: dict[str, Any]) -> list[str]:
    """Everything but the preemptible pools runs on the reserved node pool: its selector, its
    tolerations, and never a spot node."""
    out = []
    for w in workloads(objs):
        if pod_labels(w).get("spotrl/pool-type") == "preemptible":
            continue
        spec = pod_spec(w)
        selector, tolerations = spec.get("nodeSelector", {}), spec.get("tolerations", [])
        for key, value in reserved.get("nodeSelector", {}).items():
            if selector.get(key) != value:
                out.append(f"{name(w)}: off the reserved pool ({key}={selector.get(key)!r})")
        for t in reserved.get("tolerations", []):
            taint = {"key": t["key"], "value": t.get("value", ""), "effect": t["effect"]}
            if not tolerates(tolerations, taint):
                out.append(f"{name(w)}: does not tolerate the reserved pool's {taint}")
        if SPOT_LABELS & set(selector):
            out.append(f"{name(w)}: a reserved component on spot nodes: {selector}")
    return out


def grace_problems(objs: list[dict]) -> list[str]:
    """The pod's grace period covers the worker's drain (its preempt_grace_s and a margin), and
    on a spot preset's node fits what that platform gives a pod (PRESET_GRACE_S)."""
    out = []
    for w in workloads(objs):
        spec = pod_spec(w)
        for c in containers(w):
            if spotrl_settings(c) is not RolloutSettings:
                continue
            env = env_of(c)
            grace = float(
                env["SPOTRL_PREEMPT_GRACE_S"]["value"]
                if "SPOTRL_PREEMPT_GRACE_S" in env
                else RolloutSettings.model_fields["preempt_grace_s"].default
            )
            pod_grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            if grace + DRAIN_MARGIN_S > pod_grace:
                out.append(f"{name(w)}: {pod_grace} s to stop, the drain needs {grace} s + margin")
            selector = spec.get("nodeSelector", {})
            for preset, (labels, _) in PRESETS.items():
                on_preset = all(selector.get(k) == v for k, v in labels.items())
                if on_preset and pod_grace > PRESET_GRACE_S[preset]:
                    out.append(
                        f"{name(w)}: {pod_grace} s to stop on a {preset} node, which gives "
                        f"{PRESET_GRACE_S[preset]} s"
                    )
    return out


def token_problems(objs: list[dict], existing_secrets: frozenset[str] = frozenset()) -> list[str]:
    """Nothing listens off loopback without the tokens it accepts (the one API token, or the
    scoped ones' digests), from a Secret rendered or named by the values."""
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    out = []
    for w in workloads(objs):
        for c in containers(w):
            if spotrl_settings(c) is None:
                continue
            env = env_of(c)
            host = env.get("SPOTRL_HOST", {}).get("value", IMAGE_DEFAULT_HOST)
            if is_loopback(host):
                continue
            refs = [
                ref
                for var in ACCEPTING
                if (ref := env.get(var, {}).get("valueFrom", {}).get("secretKeyRef"))
            ]
            if not refs:
                out.append(
                    f"{name(w)}/{c['name']}: listens on {host} without a token from a Secret"
                )
            out += [
                f"{name(w)}/{c['name']}: token from {ref}, which is not rendered"
                for ref in refs
                if ref["name"] not in existing_secrets
                and ref["key"] not in secrets.get(ref["name"], {}).get("data", {})
            ]
    return out


def resource_problems(objs: list[dict]) -> list[str]:
    return [
        f"{name(w)}/{c['name']}: no {part} {res}"
        for w in workloads(objs)
        for c in containers(w)
        for part in ("requests", "limits")
        for res in ("cpu", "memory")
        if res not in c.get("resources", {}).get(part, {})
    ]


def image_problems(objs: list[dict]) -> list[str]:
    out = []
    for w in workloads(objs):
        for c in containers(w):
            image = c["image"]
            if "@sha256:" in image:
                continue
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                out.append(f"{name(w)}/{c['name']}: image {image} is not pinned by tag")
    return out


def settings_problems(objs: list[dict]) -> list[str]:
    """Every SPOTRL_* variable is a field of its service's settings class, and the whole set
    validates there (as the service will read it at start)."""
    out = []
    for w in workloads(objs):
        for c in containers(w):
            cls = spotrl_settings(c)
            if cls is None:
                continue
            names = [e["name"] for e in c.get("env", [])]
            out += [
                f"{name(w)}/{c['name']}: {var} set twice"
                for var in sorted({n for n in names if names.count(n) > 1})
            ]
            values = resolved_env(c)
            fields = {}
            for var, value in values.items():
                field = var.removeprefix("SPOTRL_").lower()
                if var.startswith("SPOTRL_") and field not in cls.model_fields:
                    out.append(f"{name(w)}/{c['name']}: {var} is no setting of {cls.__name__}")
                elif var.startswith("SPOTRL_"):
                    fields[field] = value
            try:
                cls.model_validate(fields)
            except ValidationError as exc:
                out.append(f"{name(w)}/{c['name']}: {cls.__name__} refuses its env: {exc}")
    return out


def resolved_env(container: dict) -> dict[str, str]:
    """The environment as the process sees it: Secret and pod-field values stand in, $(VAR)
    references expanded as the kubelet does."""
    out: dict[str, str] = {}
    for var, entry in env_of(container).items():
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source:
            value = secret_stand_in(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])
        elif "fieldRef" in source:
            value = POD_IP
        else:
            value = re.sub(
                r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), entry["value"]
            )
        out[var] = value
    return out


def security_problems(objs: list[dict]) -> list[str]:
    out = []
    for w in workloads(objs):
        pod = pod_spec(w).get("securityContext", {})
        if not pod.get("runAsNonRoot"):
            out.append(f"{name(w)}: may run as root")
        for c in containers(w):
            sc = c.get("securityContext", {})
            if spotrl_settings(c) and pod.get("runAsUser") != 10001:
                out.append(f"{name(w)}: not the image's user 10001")
            if not sc.get("readOnlyRootFilesystem") or sc.get("allowPrivilegeEscalation", True):
                out.append(f"{name(w)}/{c['name']}: writable root or privilege escalation")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                out.append(f"{name(w)}/{c['name']}: keeps capabilities")
    return out


def probe_problems(objs: list[dict]) -> list[str]:
    """Each service is probed by the image's healthcheck, which asks SPOTRL_PORT: the port the
    container declares as http."""
    out = []
    for w in workloads(objs):
        for c in containers(w):
            if spotrl_settings(c) is None:
                continue
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if c.get(probe, {}).get("exec", {}).get("command") != HEALTHCHECK:
                    out.append(f"{name(w)}/{c['name']}: {probe} is not the healthcheck")
            port = env_of(c).get("SPOTRL_PORT", {}).get("value")
            if port is None or container_ports(w).get("http") != int(port):
                out.append(f"{name(w)}/{c['name']}: SPOTRL_PORT {port} is not its http port")
    return out
