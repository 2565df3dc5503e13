"""Least privilege in the chart (issue 41), case by case: what each service is given with every
protection on (the default), with each off, with the rollout pools' own certificate, and what
Prometheus and the ingress do under TLS. The rules every render keeps are in security_rules.py
(test_chart.py runs them over every case); here they are shown not to be vacuous."""

import base64
import re

import pytest

from tests.chart import invariants, security_rules
from tests.chart.cases import SECURITY_SECRET, TLS_SECRET, values_of
from tests.chart.helm import CHART, render, require_tools, run_helm

pytestmark = [pytest.mark.chart, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _tools():
    require_tools()


def rendered(case: str) -> list[dict]:
    return render(values_of(case))


def notes_of(case: str) -> str:
    done = run_helm("install", "spotrl", str(CHART), "--dry-run=client", values=values_of(case))
    assert done.returncode == 0, done.stderr
    return done.stdout.partition("NOTES:")[2]


@pytest.mark.parametrize(
    ("case", "unprotected"),
    [
        ("security-off", {"security.redisAcl", "security.scopedTokens", "tls.enabled"}),
        ("tokens-only", {"security.redisAcl", "tls.enabled"}),
        ("acl-and-tls-one-token", {"security.scopedTokens"}),
    ],
)
def test_notes_say_what_is_unprotected(case, unprotected):
    said = set(re.findall(r"UNPROTECTED \(([\w.]+)=false\)", notes_of(case)))
    assert said == unprotected


def pod_env(objs: list[dict], component: str, pool_name: str = "") -> dict[str, dict]:
    (w,) = [
        w
        for w in invariants.workloads(objs)
        if security_rules.component(w) == component
        and invariants.pod_labels(w).get("spotrl/pool", "") == pool_name
    ]
    (c,) = invariants.pod_spec(w)["containers"]
    return invariants.env_of(c)


def secret_key(entry: dict) -> str:
    ref = entry["valueFrom"]["secretKeyRef"]
    return f"{ref['name']}/{ref['key']}"


def test_by_default_each_service_holds_only_its_own_credentials():
    objs = rendered("defaults")
    for pool_name in ("reserved", "spot"):
        env = pod_env(objs, "rollout", pool_name)
        assert secret_key(env["SPOTRL_TOKEN"]) == f"{SECURITY_SECRET}/worker-token"
        assert secret_key(env["SPOTRL_ACCEPT_TOKENS"]) == f"{SECURITY_SECRET}/accept-worker"
        assert env["SPOTRL_REDIS_URL"]["value"] == "rediss://spotrl-redis:6379/0"
        assert "SPOTRL_API_TOKEN" not in env
        assert env["SPOTRL_ADVERTISE_URL"]["value"].startswith("https://")
        assert env["SPOTRL_P2P"]["value"] == "false"  # no certificate names a pod's IP
    coordinator = pod_env(objs, "coordinator")
    assert secret_key(coordinator["SPOTRL_REDIS_URL"]) == f"{SECURITY_SECRET}/redis-url-coordinator"
    assert coordinator["SPOTRL_WORKER_REDIS_USERS"]["value"] == "true"
    assert "SPOTRL_TOKEN" not in coordinator  # it calls no other service
    trainer = pod_env(objs, "trainer")
    assert secret_key(trainer["SPOTRL_TOKEN"]) == f"{SECURITY_SECRET}/trainer-token"
    assert secret_key(trainer["SPOTRL_REDIS_URL"]) == f"{SECURITY_SECRET}/redis-url-trainer"
    assert "SPOTRL_REDIS_URL" not in pod_env(objs, "weightstore")  # it keeps nothing in Redis
    for component in ("coordinator", "weightstore", "trainer"):
        env = pod_env(objs, component)
        assert env["SPOTRL_PROTECT_READS"]["value"] == "true"
        assert env["SPOTRL_TLS_CA_FILE"]["value"] == "/etc/spotrl/tls/ca.crt"
    assert not [o for o in objs if o["kind"] == "Secret"]  # every secret is the user's


def test_security_off_is_the_chart_before_it():
    objs = rendered("security-off")
    for component, pool_name in (("coordinator", ""), ("rollout", "spot"), ("trainer", "")):
        env = pod_env(objs, component, pool_name)
        assert secret_key(env["SPOTRL_API_TOKEN"]) == "spotrl-token/token"
        assert env["SPOTRL_REDIS_URL"]["value"] == "redis://spotrl-redis:6379/0"
        assert env["SPOTRL_COORDINATOR_URL"]["value"] == "http://spotrl-coordinator:8100"
        assert not [v for v in env if v.startswith("SPOTRL_TLS_") or v == "SPOTRL_TOKEN"]
    assert pod_env(objs, "rollout", "spot")["SPOTRL_P2P"]["value"] == "true"
    redis = next(w for w in invariants.workloads(objs) if security_rules.component(w) == "redis")
    (server,) = invariants.containers(redis)
    assert "--aclfile" not in server["command"] and "--tls-port" not in server["command"]
    assert server["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]


def test_rollout_pools_may_have_a_certificate_of_their_own():
    objs = rendered("rollout-certificate-p2p")
    secrets = {}
    for w in invariants.workloads(objs):
        (tls,) = [v for v in invariants.pod_spec(w)["volumes"] if v["name"] == "tls"]
        secrets[security_rules.component(w)] = tls["secret"]["secretName"]
    assert secrets.pop("rollout") == "spotrl-tls-rollout"
    assert set(secrets.values()) == {TLS_SECRET}
    assert pod_env(objs, "rollout", "spot")["SPOTRL_P2P"]["value"] == "true"


def test_metrics_are_scraped_over_https_with_the_read_token():
    (monitor,) = [o for o in rendered("rollout-certificate-p2p") if o["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": TLS_SECRET, "key": "ca.crt"}
    assert endpoint["authorization"]["credentials"] == {
        "name": SECURITY_SECRET,
        "key": "read-token",
    }


def test_the_ingress_reaches_the_coordinator_over_https():
    (ingress,) = [o for o in rendered("monitoring-ingress") if o["kind"] == "Ingress"]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"


def test_a_worker_redis_url_has_no_password_with_a_managed_redis():
    objs = rendered("managed-redis")
    url = next(o for o in objs if o["metadata"]["name"] == "spotrl-redis-url")
    assert (
        secret_key(pod_env(objs, "rollout", "spot")["SPOTRL_REDIS_URL"]) == "spotrl-redis-url/url"
    )
    assert "@" not in base64.b64decode(url["data"]["url"]).decode()


def test_security_rules_catch_what_they_guard():
    """Each rule finds its breach in a render changed by hand (they are not vacuous)."""
    sec = security_rules.Security.of(values_of("defaults"))

    def broken(component: str, change) -> list[dict]:
        objs = rendered("defaults")
        w = next(w for w in invariants.workloads(objs) if security_rules.component(w) == component)
        change(invariants.pod_spec(w))
        return objs

    def admin_token(spec):
        ref = {"secretKeyRef": {"name": SECURITY_SECRET, "key": "admin-token"}}
        spec["containers"][0]["env"].append({"name": "SPOTRL_API_TOKEN", "valueFrom": ref})

    def plain_url(spec):
        env = invariants.env_of(spec["containers"][0])
        env["SPOTRL_WEIGHTSTORE_URL"]["value"] = "http://spotrl-weightstore:8200"

    def no_aclfile(spec):
        command = spec["containers"][0]["command"]
        del command[command.index("--aclfile") : command.index("--aclfile") + 2]

    def no_ca(spec):
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "tls"]

    assert security_rules.grant_problems(broken("rollout", admin_token), sec)
    assert security_rules.url_problems(broken("rollout", plain_url), sec)
    assert security_rules.redis_acl_problems(broken("redis", no_aclfile), sec)
    assert security_rules.tls_problems(broken("trainer", no_ca), sec)
    assert security_rules.tls_problems(broken("redis", no_ca), sec)
