"""The sets of values the chart is rendered with: each cloud's spot preset, KEDA on and off, HPA
mode, a managed Redis, GPUs on and off, monitoring (prometheus-operator, GKE Managed Prometheus)
and ingress on, cert-manager, isolated environments, each part of least privilege (Redis users,
scoped tokens, TLS) on and off, a Redis replica and Sentinel. Each is the chart's defaults plus
these overrides, with the Secrets that `spotrl secrets` makes named (SECURE)."""

from typing import Any

TOKEN = "chart-test-token"
SECURITY_SECRET = "spotrl-security"
TLS_SECRET = "spotrl-tls"
SECURE: dict[str, Any] = {
    "security": {"existingSecret": SECURITY_SECRET},
    "tls": {"existingSecret": TLS_SECRET},
}
# Every protection off: one token, no Redis users, plain text (the chart before issue 41).
INSECURE: dict[str, Any] = {
    "security": {"existingSecret": "", "redisAcl": False, "scopedTokens": False},
    "tls": {"enabled": False, "existingSecret": ""},
    "auth": {"token": TOKEN},
}


def pool(name: str, kind: str = "preemptible", **fields: Any) -> dict[str, Any]:
    return {"name": name, "type": kind, "engine": "hf", "replicas": 2, **fields}


RESERVED = pool("reserved", "reserved", replicas=1)
SCRAPED = {"podMonitor": {"enabled": True}, "prometheusRelease": "kube-prometheus-stack"}
FAILOVER = {"replica": {"enabled": True}, "sentinel": {"enabled": True, "replicas": 3}}
CERT_MANAGER = {"enabled": True, "caSecret": "spotrl-ca", "duration": "720h", "renewBefore": "240h"}

CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gke-spot": {"rollout": {"pools": [RESERVED, pool("spot", preset="gke-spot")]}},
    "eks-spot-keda": {
        "rollout": {"pools": [RESERVED, pool("spot", preset="eks-spot")]},
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 16},
        "monitoring": SCRAPED,
    },
    "karpenter-hpa": {
        "rollout": {"pools": [RESERVED, pool("spot", preset="karpenter")]},
        "autoscaling": {"enabled": True, "mode": "hpa"},
        "monitoring": SCRAPED,
    },
    "gke-managed-prometheus-keda": {
        "rollout": {"pools": [RESERVED, pool("spot", preset="gke-spot")]},
        "autoscaling": {"enabled": True},
        "monitoring": {"podMonitoring": {"enabled": True}},
        "coordinator": {"environments": {"network": "isolated"}},
    },
    "cert-manager": {
        "tls": {"existingSecret": "", "certManager": CERT_MANAGER},
        "rollout": {"pools": [RESERVED, pool("spot", preset="aks-spot")]},
        "models": {"accessModes": ["ReadWriteMany"]},
    },
    "cert-manager-issuer-ref": {
        "tls": {
            "existingSecret": "",
            "certManager": {
                "enabled": True,
                "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"},
            },
        },
    },
    "aks-spot-gpu": {
        "gpu": {"enabled": True},
        "trainer": {"ranks": 2, "gpus": 2},
        "rollout": {
            "pools": [
                pool("reserved", "reserved", replicas=1, engine="vllm"),
                pool(
                    "spot",
                    preset="aks-spot",
                    engine="vllm",
                    preemptGraceS=22.5,
                    nodeSelector={"gpu-type": "a10"},
                    tolerations=[{"key": "team", "operator": "Exists", "effect": "NoSchedule"}],
                ),
            ]
        },
    },
    "pools-from-defaults": {
        "rollout": {
            "pools": [
                {"name": "reserved", "type": "reserved"},
                {"name": "spot", "type": "preemptible", "preset": "gke-spot"},
            ],
            "defaults": {"engine": "vllm", "replicas": 3},
        }
    },
    # with Redis users, the URL is the workers' (no password): each gets a user at registration
    "managed-redis": {"redis": {"enabled": False, "url": "rediss://redis.example.test:6380/0"}},
    "managed-redis-password": {
        "redis": {"enabled": False, "url": "rediss://:pw@redis.example.test:6380/0"},
        "security": {"redisAcl": False},
    },
    # a replica and Sentinel: every protection on, and off
    "redis-failover": {"redis": FAILOVER},
    "redis-failover-insecure": {**INSECURE, "redis": FAILOVER},
    "security-off": INSECURE,
    "tokens-only": {"security": {"redisAcl": False}, "tls": {"enabled": False}},
    "acl-and-tls-one-token": {"security": {"scopedTokens": False}, "auth": {"token": TOKEN}},
    "rollout-certificate-p2p": {
        "tls": {"rolloutSecret": "spotrl-tls-rollout", "peerToPeer": True},
        "monitoring": {"podMonitor": {"enabled": True}, "certificateAlert": {"enabled": True}},
    },
    "two-spot-pools-keda": {
        "rollout": {
            "pools": [
                RESERVED,
                pool("gke", preset="gke-spot", p2p=False, settings={"flush_tokens": 8}),
                pool("karp", preset="karpenter", slots=16, preemptGraceS=10),
            ]
        },
        "autoscaling": {"enabled": True, "mode": "keda"},
        "monitoring": {"scrapedElsewhere": True},
    },
    "monitoring-ingress": {
        "auth": {"protectReads": True},
        "monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "ingress": {"enabled": True, "className": "nginx", "host": "rl.example.test"},
        "networkPolicy": {
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ]
        },
        "coordinator": {"settings": {"stall_after_s": 10, "reward_processes": 2}},
    },
    "existing-secret-and-claims": {
        "security": {"scopedTokens": False},
        "auth": {"token": "", "existingSecret": "my-spotrl", "existingSecretKey": "api"},
        "models": {"existingClaim": "models-rox"},
        "weightstore": {
            "replicas": 3,
            "persistence": {"existingClaim": "weights-rwx"},
        },
        "trainer": {"persistence": {"existingClaim": "ckpt"}},
        "reserved": {
            "nodeSelector": {"pool": "reserved"},
            "tolerations": [{"key": "reserved", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "policies-off": {
        **INSECURE,
        "networkPolicy": {"enabled": False},
        "reserved": {"podDisruptionBudget": {"enabled": False}},
        "weightstore": {"replicas": 2, "persistence": {"accessModes": ["ReadWriteMany"]}},
    },
}


def values_of(case: str) -> dict[str, Any]:
    return merge(SECURE, CASES[case])


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
