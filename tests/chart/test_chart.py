"""The Helm chart (deploy/helm/spotrl): `helm lint --strict`, renders over a matrix of values
(tests/chart/cases.py), every object valid on the oldest and the newest Kubernetes release we
claim, the ScaledObject valid for KEDA, the invariants of invariants.py and pod_rules.py, the
least-privilege rules of security_rules.py (each component only its own credentials, TLS on every
hop, Redis on its ACL file), and the values the chart must refuse. Where the tools are missing it
skips with the reason; with CI=true it fails instead (`make setup-chart` installs them)."""

import json
import re

import pytest

from tests.chart import cluster_rules, invariants, pod_rules, security_rules
from tests.chart.cases import CASES, SECURITY_SECRET, TLS_SECRET, TOKEN, merge, pool, values_of
from tests.chart.helm import CHART, render, render_error, require_tools, run_helm
from tests.chart.schemas import (
    KEDA_KIND,
    OLDEST_KUBERNETES,
    keda_problems,
    kubernetes_problem,
    newest_kubernetes,
)

pytestmark = [pytest.mark.chart, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _tools():
    require_tools()


def failover_of(values: dict) -> bool:
    """Whether the values ask for a Redis replica and Sentinel."""
    return bool(values.get("redis", {}).get("sentinel", {}).get("enabled"))


def rendered(case: str) -> list[dict]:
    return render(values_of(case))


def pools_of(case: str) -> list[dict]:
    return values_of(case).get("rollout", {}).get("pools") or [
        pool("reserved", "reserved"),
        pool("spot"),
    ]


@pytest.mark.parametrize("case", ["defaults", "security-off"])
def test_lint_strict(case):
    done = run_helm("lint", "--strict", str(CHART), values=values_of(case))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_objects_are_valid_kubernetes(case):
    versions = (OLDEST_KUBERNETES, newest_kubernetes())
    problems = [p for o in rendered(case) for v in versions if (p := kubernetes_problem(o, v))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", sorted(CASES))
def test_invariants(case):
    objs = rendered(case)
    values = values_of(case)
    existing = frozenset(
        (values.get("auth", {}).get("existingSecret", ""), values["security"]["existingSecret"])
    )
    sec = security_rules.Security.of(values)
    problems = (
        invariants.selector_problems(objs)
        + invariants.scrape_problems(objs)
        + pod_rules.spot_problems(objs, pools_of(case))
        + pod_rules.reserved_problems(objs, values_of(case).get("reserved", {}))
        + pod_rules.grace_problems(objs)
        + pod_rules.token_problems(objs, existing)
        + pod_rules.resource_problems(objs)
        + pod_rules.image_problems(objs)
        + pod_rules.settings_problems(objs)
        + pod_rules.security_problems(objs)
        + pod_rules.probe_problems(objs)
        + invariants.failover_problems(objs, failover_of(values))
        + security_rules.grant_problems(objs, sec)
        + security_rules.url_problems(objs, sec)
        + security_rules.tls_problems(objs, sec)
        + security_rules.redis_acl_problems(objs, sec)
        + security_rules.reloader_problems(objs, sec)
        + cluster_problems(objs, values)
    )
    assert not problems, "\n".join(problems)


def cluster_problems(objs: list[dict], values: dict) -> list[str]:
    """The rules of cluster_rules.py (issue 48) over one render."""
    cm = values.get("tls", {}).get("certManager", {})
    certificates = (
        cluster_rules.certificate_problems(
            objs, cm.get("duration", "2160h"), cm.get("renewBefore", "720h")
        )
        if cm.get("enabled")
        else []
    )
    return (
        cluster_rules.spot_placement_problems(objs)
        + cluster_rules.rwo_problems(objs)
        + cluster_rules.pdb_problems(objs)
        + cluster_rules.redis_memory_problems(objs)
        + cluster_rules.subpath_problems(objs)
        + cluster_rules.scrape_target_problems(
            objs,
            values.get("monitoring", {}).get("prometheusRelease", ""),
            values.get("monitoring", {}).get("scrapedElsewhere", False),
        )
        + cluster_rules.ingress_problems(objs)
        + cluster_rules.sandbox_problems(objs)
        + certificates
    )


# Settings the chart never lets values set: one value per Deployment would be one per replica;
# credentials come from Secrets only, never from values.
NOT_SETTABLE = {"fault_crash_requests", "worker_id", "replica_id"} | {
    "api_token",
    "token",
    "accept_tokens",
    "redis_url",
}
SETTINGS_AT = {
    "CoordinatorSettings": ("coordinator",),
    "WeightStoreSettings": ("weightstore",),
    "TrainerSettings": ("trainer",),
    "RolloutSettings": ("rollout", "pools", "items"),
}


def test_schema_lets_values_set_every_setting_the_chart_does_not():
    """values.schema.json lists the settings a values file may set per service: each a field of
    its class, and every field but those the chart sets itself, with least privilege on or off
    (a typo fails at install)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    chart_sets: dict[type, set[str]] = {}
    for w in invariants.workloads(rendered("defaults") + rendered("security-off")):
        for c in invariants.containers(w):
            if cls := invariants.spotrl_settings(c):
                names = {e["name"].removeprefix("SPOTRL_").lower() for e in c["env"]}
                chart_sets.setdefault(cls, set()).update(names)
    assert len(chart_sets) == len(SETTINGS_AT)
    for cls, chart_set in chart_sets.items():
        node = schema
        for key in SETTINGS_AT[cls.__name__]:
            node = node["items"] if key == "items" else node["properties"][key]
        listed = set(node["properties"]["settings"]["propertyNames"]["enum"])
        want = set(cls.model_fields) - chart_set - NOT_SETTABLE
        assert listed == want, (
            f"{cls.__name__}: add {sorted(want - listed)} to, and remove {sorted(listed - want)} "
            "from, its settings names in values.schema.json"
        )


def test_an_unknown_kind_is_invalid():
    service = next(o for o in rendered("defaults") if o["kind"] == "Service")
    assert kubernetes_problem({**service, "apiVersion": "v2"}, OLDEST_KUBERNETES)


def notes_of(case: str) -> str:
    done = run_helm("install", "spotrl", str(CHART), "--dry-run=client", values=values_of(case))
    assert done.returncode == 0, done.stderr
    return done.stdout.partition("NOTES:")[2]


def test_notes_say_how_to_submit_a_run_and_open_the_dashboard():
    notes = notes_of("defaults")
    assert "port-forward svc/spotrl-coordinator 8100:8100" in notes
    assert "/v1/runs" in notes and "dashboard" in notes
    assert f"secret {SECURITY_SECRET} -o jsonpath='{{.data.admin-token}}'" in notes
    assert f"secret {TLS_SECRET}" in notes and "https://localhost:8100" in notes
    assert "UNPROTECTED" not in notes
    assert "secret spotrl-token" in notes_of("security-off")


def test_defaults_are_a_small_cpu_deployment():
    objs = rendered("defaults")
    kinds = sorted(invariants.name(o) for o in invariants.workloads(objs))
    assert kinds == [
        "Deployment/spotrl-coordinator",
        "Deployment/spotrl-rollout-reserved",
        "Deployment/spotrl-rollout-spot",
        "Deployment/spotrl-trainer",
        "Deployment/spotrl-weightstore",
        "StatefulSet/spotrl-redis",
    ]
    assert not [o for o in objs if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    for w in invariants.workloads(objs):
        for c in invariants.containers(w):
            assert not [r for r in c["resources"]["limits"] if "gpu" in r], invariants.name(w)
            env = invariants.env_of(c)
            assert env.get("SPOTRL_ENGINE", {"value": "hf"})["value"] == "hf"
            assert env.get("SPOTRL_DEVICE", {"value": "cpu"})["value"] == "cpu"
    redis = next(w for w in invariants.workloads(objs) if w["kind"] == "StatefulSet")
    command = redis["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    assert redis["spec"]["volumeClaimTemplates"]


@pytest.mark.parametrize("case", ["eks-spot-keda", "two-spot-pools-keda"])
def test_scaled_objects_are_valid_keda_and_hold_wanted(case):
    scaled = [o for o in rendered(case) if (o["apiVersion"], o["kind"]) == KEDA_KIND]
    spot = [p["name"] for p in pools_of(case) if p["type"] == "preemptible"]
    assert sorted(o["metadata"]["name"] for o in scaled) == sorted(
        f"spotrl-rollout-{p}" for p in spot
    )
    for o in scaled:
        assert keda_problems(o) == []
        (trigger,) = o["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        # replicas = ceil(query / threshold): each of K pools holds its share of `wanted`
        assert trigger["metadata"]["threshold"] == str(len(spot))
        assert "spotrl_coordinator_preemptible_wanted" in trigger["metadata"]["query"]
        assert o["spec"]["fallback"]["replicas"] >= 0


def test_keda_schema_refuses_a_misspelt_field():
    scaled = next(o for o in rendered("eks-spot-keda") if o["kind"] == "ScaledObject")
    scaled["spec"]["maxReplicaCont"] = scaled["spec"].pop("maxReplicaCount")
    assert any("maxReplicaCont" in p for p in keda_problems(scaled))


def test_hpa_mode_scales_on_the_external_metric():
    (hpa,) = [o for o in rendered("karpenter-hpa") if o["kind"] == "HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "spotrl_rollout_replicas_wanted"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["minReplicas"] == 1  # an HPA cannot go below 1


def test_gpu_case_asks_for_gpus_and_ranks():
    objs = rendered("aks-spot-gpu")
    trainer = next(
        w for w in invariants.workloads(objs) if w["metadata"]["name"] == "spotrl-trainer"
    )
    (c,) = trainer["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert invariants.env_of(c)["SPOTRL_TRAINER_RANKS"]["value"] == "2"
    assert invariants.env_of(c)["SPOTRL_DEVICE"]["value"] == "cuda"


def test_pools_take_what_they_do_not_set_from_the_defaults():
    objs = rendered("pools-from-defaults")
    for name in ("reserved", "spot"):
        w = pod_rules.pool_workload(objs, name)
        assert w["spec"]["replicas"] == 3
        (c,) = w["spec"]["template"]["spec"]["containers"]
        assert invariants.env_of(c)["SPOTRL_ENGINE"]["value"] == "vllm"


def test_managed_redis_renders_no_redis_objects():
    objs = rendered("managed-redis")
    assert not [o for o in objs if o["metadata"]["name"].endswith("-redis")]


REFUSED = {
    "no security Secret": (
        {"security": {"existingSecret": ""}},
        "security.existingSecret is required",
    ),
    "no security Secret, Redis users only": (
        {"security": {"existingSecret": "", "scopedTokens": False}, "auth": {"token": TOKEN}},
        "in namespace rl (docs/deploy-kubernetes.md",
    ),
    "no TLS Secret": ({"tls": {"existingSecret": ""}}, "tls.existingSecret is required"),
    "a worker's Redis URL with a password": (
        {"redis": {"enabled": False, "url": "rediss://:pw@redis.example.test:6380/0"}},
        "no credentials in it",
    ),
    "a credential in settings": (
        {"rollout": {"pools": [pool("spot", settings={"accept_tokens": "admin:00"})]}},
        "accept_tokens",
    ),
    "no token": (
        {"security": {"scopedTokens": False}, "auth": {"token": ""}},
        "auth.token or auth.existingSecret is required",
    ),
    "a short token": ({"auth": {"token": "secret"}}, "auth/token"),
    "a misspelt key": ({"rollout": {"pols": []}}, "pols"),
    "a misspelt pool field": (
        {"rollout": {"pools": [{**pool("spot"), "presett": "gke-spot"}]}},
        "presett",
    ),
    "a misspelt setting": (
        {"rollout": {"pools": [pool("spot", settings={"flush_token": 8})]}},
        "flush_token",
    ),
    "a setting the chart sets itself": ({"trainer": {"settings": {"port": 9000}}}, "port"),
    "an unknown preset": ({"rollout": {"pools": [pool("spot", preset="gcp")]}}, "preset"),
    "the latest tag": ({"image": {"repository": "spotrl", "tag": "latest"}}, "tag"),
    "a GKE spot grace over 15 s": (
        {"rollout": {"pools": [pool("spot", preset="gke-spot", preemptGraceS=20)]}},
        "over the 15 s a gke-spot node gives a pod",
    ),
    "an AKS spot grace over 30 s": (
        {"rollout": {"pools": [pool("spot", preset="aks-spot", preemptGraceS=28)]}},
        "over the 30 s a aks-spot node gives a pod",
    ),
    "autoscaling that nothing scrapes": (
        {"autoscaling": {"enabled": True}},
        "the query would be empty forever",
    ),
    "GKE's gce ingress class": (
        {"ingress": {"enabled": True, "className": "gce"}},
        "ingress.className=gce is refused",
    ),
    "an ingress class whose controller the policy cannot name": (
        {"ingress": {"enabled": True, "className": "traefik"}},
        "set networkPolicy.ingressControllerNamespace",
    ),
    "environment_network as a setting": (
        {"coordinator": {"settings": {"environment_network": True}}},
        "environment_network",
    ),
    "cert-manager without a CA": (
        {"tls": {"existingSecret": "", "certManager": {"enabled": True}}},
        "set tls.certManager.caSecret",
    ),
    "a PDB that blocks drains": (
        {"reserved": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": 0}}},
        "maxUnavailable",
    ),
    "a reserved pool on spot": (
        {"rollout": {"pools": [pool("r", "reserved", preset="eks-spot")]}},
        "is reserved",
    ),
    "shared weights on one node's volume": ({"weightstore": {"replicas": 2}}, "ReadWriteMany"),
    "no Redis at all": ({"redis": {"enabled": False}}, "needs redis.url"),
    "two pools of one name": (
        {"rollout": {"pools": [pool("spot"), pool("spot")]}},
        "used twice",
    ),
    "an HPA to zero": (
        {"autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 0}},
        "at least 1",
    ),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_render_refuses(what):
    overrides, says = REFUSED[what]
    error = render_error(merge(values_of("defaults"), overrides))
    assert re.search(re.escape(says), error), error
