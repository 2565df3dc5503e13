"""The chart on a real cluster (issue 48): the autoscaler's query evaluated by promtool, the
prometheus-adapter rule the NOTES print, cert-manager's objects, the reserved side's placement,
and each rule of cluster_rules.py (and the extended grace, reloader rules) shown failing on
purpose once, on a render broken the way the chart used to be (test_each_rule_fails_on_purpose:
its assertion message and output carry the problem text)."""

import itertools
import re
from collections.abc import Callable

import pytest
import yaml

from tests.chart import cluster_rules, invariants, pod_rules, promql, security_rules
from tests.chart.cases import merge, values_of
from tests.chart.helm import CHART, render, render_error, require_tools, run_helm

pytestmark = [pytest.mark.chart, pytest.mark.timeout(300)]
CERT_MANAGER_API = ("cert-manager.io/v1",)
# The query of the chart before issue 48: 0 (no run, or no figure yet) read as "hold all".
OLD_QUERY = (
    '(max(spotrl_coordinator_preemptible_wanted{namespace="rl", container="coordinator"}) > 0)'
    ' or (0 * max(spotrl_coordinator_preemptible_wanted{namespace="rl", '
    'container="coordinator"}) + 16)'
)


@pytest.fixture(autouse=True)
def _tools():
    require_tools()


def workload(objs: list[dict], component: str, pool: str = "") -> dict:
    (w,) = [
        w
        for w in invariants.workloads(objs)
        if security_rules.component(w) == component
        and invariants.pod_labels(w).get("spotrl/pool", "") == pool
    ]
    return w


@pytest.mark.parametrize(
    "case", ["eks-spot-keda", "two-spot-pools-keda", "gke-managed-prometheus-keda"]
)
def test_the_keda_query_reads_no_run_as_the_minimum(case):
    promql.require_promtool()
    objs = render(values_of(case))
    assert [o for o in objs if o["kind"] == "ScaledObject"]
    assert promql.scaled_object_problems(objs) == []
    for o in (o for o in objs if o["kind"] == "ScaledObject"):
        assert o["spec"]["minReplicaCount"] == 0  # scale to zero: KEDA's default minimum here


def test_the_hpa_adapter_rule_in_the_notes_means_what_the_keda_query_means():
    promql.require_promtool()
    done = run_helm(
        "install",
        "spotrl",
        str(CHART),
        "--dry-run=client",
        "-n",
        "rl",
        values=values_of("karpenter-hpa"),
    )
    assert done.returncode == 0, done.stderr
    notes = done.stdout.partition("NOTES:")[2]
    after = notes.partition("(rules.external)")[2].split("\n")[1:]
    block = "\n".join(itertools.takewhile(lambda line: line.startswith("    "), after))
    (rule,) = yaml.safe_load(block)
    assert rule["name"]["as"] == "spotrl_rollout_replicas_wanted"
    query = rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="rl"')
    assert promql.query_problems(query, hold_all=8) == []  # maxReplicas 8, one pool


def test_cert_manager_is_the_default_where_it_is_installed():
    values = merge(
        values_of("defaults"), {"tls": {"existingSecret": "", "certManager": {"caSecret": "ca"}}}
    )
    objs = render(values, api_versions=CERT_MANAGER_API)
    kinds = sorted(invariants.name(o) for o in objs if o["apiVersion"] == "cert-manager.io/v1")
    assert kinds == ["Certificate/spotrl-tls", "Certificate/spotrl-tls-rollout", "Issuer/spotrl-ca"]
    assert cluster_rules.certificate_problems(objs, "2160h", "720h") == []
    server = next(o for o in objs if invariants.name(o) == "Certificate/spotrl-tls")
    assert {"spotrl-coordinator", "spotrl-redis", "localhost"} <= set(server["spec"]["dnsNames"])
    rollout = next(o for o in objs if invariants.name(o) == "Certificate/spotrl-tls-rollout")
    assert rollout["spec"]["dnsNames"] == ["localhost"]  # a spot worker names nothing else
    # without cert-manager the same values want a Secret of the user's
    assert "tls.existingSecret is required" in render_error(values)


def test_an_issuer_of_the_users_replaces_the_ca_issuer():
    objs = render(values_of("cert-manager-issuer-ref"))
    assert not [o for o in objs if o["kind"] == "Issuer"]
    for cert in (o for o in objs if o["kind"] == "Certificate"):
        assert cert["spec"]["issuerRef"]["name"] == "corp-ca"
        assert cert["spec"]["issuerRef"]["kind"] == "ClusterIssuer"


def test_models_on_read_write_many_need_no_shared_node():
    objs = render(values_of("cert-manager"))  # models accessModes [ReadWriteMany]
    for component in ("coordinator", "trainer"):
        spec = invariants.pod_spec(workload(objs, component))
        assert "podAffinity" not in spec.get("affinity", {})


def _objs(case: str, **values) -> list[dict]:
    return render(merge(values_of(case), values))


def _mutate(
    case: str, component: str, change: Callable[[dict], None], pool: str = ""
) -> list[dict]:
    objs = render(values_of(case))
    change(workload(objs, component, pool))
    return objs


def _without_pod_affinity(w: dict) -> None:
    invariants.pod_spec(w)["affinity"].pop("podAffinity")


def _two_replicas(w: dict) -> None:
    w["spec"]["replicas"] = 2


def _old_grace(w: dict) -> None:  # the chart before issue 48: 20 s drain, 25 s on every preset
    spec = invariants.pod_spec(w)
    spec["terminationGracePeriodSeconds"] = 25
    invariants.env_of(spec["containers"][0])["SPOTRL_PREEMPT_GRACE_S"]["value"] = "20"


def _tls_by_subpath(w: dict) -> None:
    mount = next(
        m for m in invariants.pod_spec(w)["containers"][0]["volumeMounts"] if m["name"] == "tls"
    )
    mount.update(mountPath="/etc/spotrl/tls/tls.crt", subPath="tls.crt")


def _no_environment_network(w: dict) -> None:  # the chart before: the setting's default, false
    c = invariants.pod_spec(w)["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "SPOTRL_ENVIRONMENT_NETWORK"]


def _password_on_redis_server(w: dict) -> None:
    ref = {"secretKeyRef": {"name": "spotrl-security", "key": "redis-password-certs"}}
    server = next(c for c in invariants.containers(w) if c["name"] == "redis")
    server.setdefault("env", []).append({"name": "REDISCLI_AUTH", "valueFrom": ref})


def _no_reloader(w: dict) -> None:
    spec = invariants.pod_spec(w)
    spec["containers"] = [c for c in spec["containers"] if c["name"] != "tls-reloader"]


def _blocking_pdbs() -> list[dict]:
    objs = render(values_of("defaults"))
    for o in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        o["spec"].pop("maxUnavailable")
        o["spec"]["minAvailable"] = 1  # the chart before issue 48
    return objs


def _certificates(change: Callable[[dict], None]) -> list[dict]:
    objs = render(values_of("cert-manager"))
    for o in (o for o in objs if o["kind"] == "Certificate"):
        change(o["spec"])
    return objs


def _monitors(case: str, change: Callable[[list[dict]], list[dict]]) -> list[dict]:
    return change(render(values_of(case)))


def _strip_release_label(objs: list[dict]) -> list[dict]:
    for o in (o for o in objs if o["kind"] == "PodMonitor"):
        o["metadata"]["labels"].pop("release")
    return objs


def _ingress_without_class(objs: list[dict]) -> list[dict]:
    for o in (o for o in objs if o["kind"] == "Ingress"):
        o["spec"].pop("ingressClassName")
    return objs


# Each rule, a render broken the way the chart was (or could be), and what the rule must say.
ON_PURPOSE: dict[str, tuple[Callable[[], list[str]], str]] = {
    "promql.scaled_object_problems: the old query holds all with no run": (
        lambda: promql.scaled_object_problems(
            _objs("eks-spot-keda", autoscaling={"prometheus": {"query": OLD_QUERY}})
        ),
        "want 0, got {} 1.6E+01",
    ),
    "spot_placement_problems: reserved.avoidSpot=false": (
        lambda: cluster_rules.spot_placement_problems(
            _objs("gke-spot", reserved={"avoidSpot": False})
        ),
        "StatefulSet/spotrl-redis: may schedule onto a gke-spot node",
    ),
    "rwo_problems: coordinator and trainer without pod affinity": (
        lambda: cluster_rules.rwo_problems(
            _mutate("defaults", "coordinator", _without_pod_affinity)
        ),
        "mounts ReadWriteOnce spotrl-models with no pod affinity",
    ),
    "rwo_problems: two weight stores on one ReadWriteOnce claim": (
        lambda: cluster_rules.rwo_problems(_mutate("defaults", "weightstore", _two_replicas)),
        "2 replicas on ReadWriteOnce spotrl-weights",
    ),
    "pdb_problems: minAvailable 1 on one replica": (
        lambda: cluster_rules.pdb_problems(_blocking_pdbs()),
        "allows 0 disruptions of 1 pod(s)",
    ),
    "redis_memory_problems: maxmemory 1gb under a 1536Mi limit": (
        lambda: cluster_rules.redis_memory_problems(_objs("defaults", redis={"maxmemory": "1gb"})),
        "maxmemory 1gb over half the 1536Mi limit",
    ),
    "subpath_problems: the certificate by subPath": (
        lambda: cluster_rules.subpath_problems(_mutate("defaults", "coordinator", _tls_by_subpath)),
        "tls by subPath never updates",
    ),
    "certificate_problems: renewBefore as long as the duration": (
        lambda: cluster_rules.certificate_problems(
            _certificates(lambda s: s.update(renewBefore="720h")), "720h", "240h"
        ),
        "renewBefore is not under its duration",
    ),
    "certificate_problems: a lifetime the values did not ask for": (
        lambda: cluster_rules.certificate_problems(
            _certificates(lambda s: s.update(duration="168h")), "720h", "240h"
        ),
        "duration 168h, the values say 720h",
    ),
    "scrape_target_problems: no release label for kube-prometheus-stack": (
        lambda: cluster_rules.scrape_target_problems(
            _monitors("eks-spot-keda", _strip_release_label), "kube-prometheus-stack"
        ),
        "no label release=kube-prometheus-stack",
    ),
    "scrape_target_problems: an autoscaler and no monitor": (
        lambda: cluster_rules.scrape_target_problems(
            _monitors("eks-spot-keda", lambda objs: [o for o in objs if o["kind"] != "PodMonitor"]),
            "",
        ),
        "no monitor scrapes them",
    ),
    "ingress_problems: no ingress class": (
        lambda: cluster_rules.ingress_problems(
            _monitors("monitoring-ingress", _ingress_without_class)
        ),
        "no ingressClassName",
    ),
    "sandbox_problems: isolated environments under RuntimeDefault": (
        lambda: cluster_rules.sandbox_problems(
            _mutate("defaults", "coordinator", _no_environment_network)
        ),
        "unshare(CLONE_NEWUSER|CLONE_NEWNET) is refused",
    ),
    "grace_problems: the old 25 s on a GKE spot node": (
        lambda: pod_rules.grace_problems(_mutate("gke-spot", "rollout", _old_grace, pool="spot")),
        "25 s to stop on a gke-spot node, which gives 15 s",
    ),
    "reloader_problems: redis-server holds the reloader's password": (
        lambda: security_rules.reloader_problems(
            _mutate("defaults", "redis", _password_on_redis_server),
            security_rules.Security.of(values_of("defaults")),
        ),
        "StatefulSet/spotrl-redis/redis: reads ['redis-password-certs']",
    ),
    "reloader_problems: no reloader": (
        lambda: security_rules.reloader_problems(
            _mutate("defaults", "redis", _no_reloader),
            security_rules.Security.of(values_of("defaults")),
        ),
        "nothing has Redis re-read a renewed certificate",
    ),
}


@pytest.mark.parametrize("what", sorted(ON_PURPOSE))
def test_each_rule_fails_on_purpose(what):
    if what.startswith("promql"):
        promql.require_promtool()
    problems, says = ON_PURPOSE[what][0](), ON_PURPOSE[what][1]
    print(f"{what}:\n  " + "\n  ".join(problems))
    assert any(says in p for p in problems), f"{what}: want {says!r} among {problems}"


def test_reserved_pools_keep_their_own_affinity_and_avoid_spot():
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    objs = _objs("gke-spot", reserved={"affinity": affinity})
    (term,) = invariants.pod_spec(workload(objs, "redis"))["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    keys = [e["key"] for e in term["matchExpressions"]]
    assert keys[0] == "pool" and "cloud.google.com/gke-spot" in keys
    assert cluster_rules.spot_placement_problems(objs) == []


def test_grace_comes_from_the_preset():
    for case, pool, grace, drain in (
        ("gke-spot", "spot", 15, "10"),
        ("eks-spot-keda", "spot", 120, "115"),
    ):
        spec = invariants.pod_spec(workload(render(values_of(case)), "rollout", pool))
        assert spec["terminationGracePeriodSeconds"] == grace
        assert invariants.env_of(spec["containers"][0])["SPOTRL_PREEMPT_GRACE_S"]["value"] == drain
    assert re.search(
        "over the 15 s",
        render_error(
            merge(
                values_of("defaults"),
                {
                    "rollout": {
                        "pools": [
                            {
                                "name": "spot",
                                "type": "preemptible",
                                "preset": "gke-spot",
                                "preemptGraceS": 12,
                            }
                        ]
                    }
                },
            )
        ),
    )


def test_the_certificate_alert_fires_within_days_before():
    promql.require_promtool()
    (rule,) = [
        o for o in render(values_of("rollout-certificate-p2p")) if o["kind"] == "PrometheusRule"
    ]
    (alert,) = rule["spec"]["groups"][0]["rules"]
    fires = f"count({alert['expr']})"  # one sample (1) when some certificate is near expiry
    gauge = "spotrl_tls_certificate_expiry_timestamp_seconds"
    day_s = 86400  # at evaluation time() is 0: the gauge is the time left
    assert (
        promql.expectation_problem(fires, {gauge: 10 * day_s}, 1, promql.COORDINATOR_LABELS) == ""
    )
    assert (
        promql.expectation_problem(fires, {gauge: 20 * day_s}, None, promql.COORDINATOR_LABELS)
        == ""
    )
