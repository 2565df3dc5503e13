"""Least-privilege rules on a render (issue 41): which Secret keys each component reads, TLS on
every hop, Redis on its ACL file. Each returns what breaks the rule (empty: nothing). The grants
are restated here from the issue, never read from the templates."""

import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.chart.invariants import (
    containers,
    env_of,
    name,
    pod_labels,
    pod_spec,
    spotrl_settings,
    workloads,
)

# The keys of the security Secret (`spotrl secrets`) each component may read: a rollout worker
# holds its own token and accept list, never an admin or trainer token, a role's Redis password
# or the ACL file.
GRANTS: dict[str, set[str]] = {
    "coordinator": {"redis-url-coordinator", "accept-coordinator"},
    "weightstore": {"accept-weightstore"},
    "trainer": {"redis-url-trainer", "trainer-token", "accept-trainer"},
    "rollout": {"worker-token", "accept-worker"},
    "redis": {"aclfile", "redis-password-certs", "redis-password-replica"},
    "sentinel": {"redis-password-sentinel"},
}
# Within the Redis pod, by container: the ACL file's copier reads the file, the TLS reloader the
# spotrl-certs user's password (PING and CONFIG SET only), redis-server nothing.
# With a replica, its `node` container what the node logs in to its primary as.
REDIS_CONTAINER_GRANTS = {
    "aclfile": {"aclfile"},
    "tls-reloader": {"redis-password-certs"},
    "node": {"redis-password-replica"},
}
NEVER_ON_ROLLOUT = {"admin-token", "trainer-token", "aclfile"}  # and every redis-url-*
SECURE_SCHEMES = {"https", "rediss", "rediss+sentinel"}
TLS_FILES = {"SPOTRL_TLS_CERT_FILE": "tls.crt", "SPOTRL_TLS_KEY_FILE": "tls.key"}
TLS_CA = {"SPOTRL_TLS_CA_FILE": "ca.crt"}
# The Secrets cert-manager writes for release "spotrl" (docs/deploy-kubernetes.md, "Certificates").
CERT_MANAGER_SECRETS = frozenset({"spotrl-tls", "spotrl-tls-rollout"})


@dataclass(frozen=True)
class Security:
    """What a render's values switch on, and the Secrets they name."""

    secret: str
    tls_secrets: frozenset[str]
    redis_acl: bool
    scoped_tokens: bool
    tls: bool

    @classmethod
    def of(cls, values: dict[str, Any]) -> "Security":
        s, t = values.get("security", {}), values.get("tls", {})
        return cls(
            secret=s.get("existingSecret", ""),
            tls_secrets=CERT_MANAGER_SECRETS
            if t.get("certManager", {}).get("enabled")
            else frozenset(x for x in (t.get("existingSecret"), t.get("rolloutSecret")) if x),
            redis_acl=s.get("redisAcl", True),
            scoped_tokens=s.get("scopedTokens", True),
            tls=t.get("enabled", True),
        )


def component(workload: dict) -> str:
    return pod_labels(workload).get("app.kubernetes.io/component", "")


def secret_keys_read(workload: dict, secret: str) -> set[str]:
    """Every key of `secret` the pod reads: env, envFrom and volumes ('*' for the whole)."""
    keys: set[str] = set()
    for c in containers(workload):
        for entry in c.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] == secret:
                keys.add(ref["key"])
        for source in c.get("envFrom", []):
            if source.get("secretRef", {}).get("name") == secret:
                keys.add("*")
    for volume in pod_spec(workload).get("volumes", []):
        projected = [volume.get("secret")] + [
            p.get("secret") for p in volume.get("projected", {}).get("sources", [])
        ]
        for s in projected:
            if s and (s.get("secretName") or s.get("name")) == secret:
                keys |= {i["key"] for i in s["items"]} if s.get("items") else {"*"}
    return keys


def grant_problems(objs: list[dict], sec: Security) -> list[str]:
    """Each component reads only its own keys of the security Secret; a rollout pool none that
    lets it act as another role."""
    if not sec.secret:
        return []
    out = []
    for w in workloads(objs):
        keys = secret_keys_read(w, sec.secret)
        extra = keys - GRANTS.get(component(w), set())
        if extra:
            out.append(f"{name(w)}: reads {sorted(extra)} of {sec.secret}, not its own")
        if component(w) == "rollout":
            bad = keys & (NEVER_ON_ROLLOUT | {"*"}) | {k for k in keys if k.startswith("redis-url")}
            out += [f"{name(w)}: a rollout pool holds {k}" for k in sorted(bad)]
    return out


def url_problems(objs: list[dict], sec: Security) -> list[str]:
    """With TLS every URL a service is given is https:// or rediss://; a worker's Redis URL
    never holds a password (its user comes at registration)."""
    out = []
    for w in workloads(objs):
        for c in containers(w):
            for var, entry in env_of(c).items():
                value = entry.get("value", "")
                if "://" not in value:
                    continue
                scheme = urlsplit(value.replace("$(", "").replace(")", "")).scheme
                if sec.tls and scheme not in SECURE_SCHEMES:
                    out.append(f"{name(w)}/{c['name']}: {var}={value} is not TLS")
                if var == "SPOTRL_REDIS_URL" and "@" in value:
                    out.append(f"{name(w)}/{c['name']}: a Redis password in plain sight")
    return out


def mounted_key(workload: dict, container: dict, path: str) -> tuple[str, str] | None:
    """(Secret, key) a file of `container` comes from, None when no Secret volume holds it."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if posixpath.dirname(path) != mount["mountPath"].rstrip("/"):
            continue
        secret = volumes.get(mount["name"], {}).get("secret")
        if not secret:
            continue
        file = posixpath.basename(path)
        for item in secret.get("items") or [{"key": file, "path": file}]:
            if item["path"] == file:
                return secret["secretName"], item["key"]
    return None


def tls_problems(objs: list[dict], sec: Security) -> list[str]:
    """With TLS every spotrl service has its certificate, key and CA, each a file of the TLS
    Secret it mounts; Redis listens on TLS only."""
    if not sec.tls:
        return []
    out = []
    for w in workloads(objs):
        for c in containers(w):
            env = env_of(c)
            wanted = {**TLS_FILES, **TLS_CA} if spotrl_settings(c) else {}
            for var, key in wanted.items():
                path = env.get(var, {}).get("value")
                found = mounted_key(w, c, path) if path else None
                if found is None or found[0] not in sec.tls_secrets or found[1] != key:
                    out.append(f"{name(w)}/{c['name']}: {var} is not {key} of a TLS Secret")
        if component(w) == "redis":
            out += redis_tls_problems(w, sec)
    return out


def redis_tls_problems(redis: dict, sec: Security) -> list[str]:
    server = next(c for c in containers(redis) if c["command"][0] == "redis-server")
    args = dict(zip(server["command"][1::2], server["command"][2::2], strict=False))
    out = []
    if args.get("--port") != "0" or "--tls-port" not in server["command"]:
        out.append(f"{name(redis)}: a plain port open (--port {args.get('--port')})")
    for flag, key in (
        ("--tls-cert-file", "tls.crt"),
        ("--tls-key-file", "tls.key"),
        ("--tls-ca-cert-file", "ca.crt"),
    ):
        found = mounted_key(redis, server, args.get(flag, ""))
        if found is None or found[0] not in sec.tls_secrets or found[1] != key:
            out.append(f"{name(redis)}: {flag} is not {key} of a TLS Secret")
    return out


def redis_acl_problems(objs: list[dict], sec: Security) -> list[str]:
    """With the ACL on, redis-server loads a file on a writable volume (ACL SAVE keeps the
    workers' users) that a container of its pod fills from the Secret's aclfile; the
    coordinator mints workers' users."""
    out = []
    for w in workloads(objs):
        if component(w) == "coordinator":
            (c,) = containers(w)
            minted = env_of(c).get("SPOTRL_WORKER_REDIS_USERS", {}).get("value") == "true"
            if minted != sec.redis_acl:
                out.append(f"{name(w)}: worker_redis_users is {minted}, ACL {sec.redis_acl}")
        if component(w) != "redis":
            continue
        server = next(c for c in containers(w) if c["command"][0] == "redis-server")
        command = server["command"]
        if not sec.redis_acl:
            if "--aclfile" in command:
                out.append(f"{name(w)}: an ACL file with security.redisAcl off")
            continue
        if "--aclfile" not in command:
            out.append(f"{name(w)}: no --aclfile")
            continue
        path = command[command.index("--aclfile") + 1]
        holder = [
            m["name"]
            for m in server.get("volumeMounts", [])
            if path.startswith(m["mountPath"].rstrip("/") + "/") and not m.get("readOnly")
        ]
        if not holder:
            out.append(f"{name(w)}: {path} is on no writable volume of redis-server")
        if "aclfile" not in secret_keys_read(w, sec.secret):
            out.append(f"{name(w)}: the pod mounts no aclfile of {sec.secret}")
        fills = [
            c
            for c in containers(w)
            if any(m["name"] in holder for m in c.get("volumeMounts", []))
            and any(aclfile_volume(w, sec, m["name"]) for m in c.get("volumeMounts", []))
        ]
        if not fills:
            out.append(f"{name(w)}: no container copies the aclfile to {path}")
    return out


def aclfile_volume(workload: dict, sec: Security, volume: str) -> bool:
    for v in pod_spec(workload).get("volumes", []):
        s = v.get("secret") or {}
        if v["name"] == volume and s.get("secretName") == sec.secret:
            return any(i["key"] == "aclfile" for i in s.get("items") or [{"key": "aclfile"}])
    return False


def container_keys_read(workload: dict, container: dict, secret: str) -> set[str]:
    """The keys of `secret` one container reads: its env, and the Secret volumes it mounts."""
    keys = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in container.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == secret
    }
    mounted = {m["name"] for m in container.get("volumeMounts", [])}
    for v in pod_spec(workload).get("volumes", []):
        s = v.get("secret") or {}
        if v["name"] in mounted and s.get("secretName") == secret:
            keys |= {i["key"] for i in s.get("items") or [{"key": "*"}]}
    return keys


def reloader_problems(objs: list[dict], sec: Security) -> list[str]:
    """Under TLS the Redis pod has a container that has Redis re-read its files (CONFIG SET of
    tls-cert-file, tls-key-file, tls-ca-cert-file) and mounts the TLS Secret; each container of
    the pod reads only its own keys of the security Secret."""
    out = []
    for w in (w for w in workloads(objs) if component(w) == "redis"):
        if sec.secret:
            for c in containers(w):
                extra = container_keys_read(w, c, sec.secret) - REDIS_CONTAINER_GRANTS.get(
                    c["name"], set()
                )
                if extra:
                    out.append(f"{name(w)}/{c['name']}: reads {sorted(extra)} of {sec.secret}")
        if not sec.tls:
            continue
        script = {c["name"]: " ".join(c.get("command", [])) for c in containers(w)}
        reloads = [
            n
            for n, text in script.items()
            if all(f in text for f in ("CONFIG SET", "tls-cert-file", "tls-key-file"))
        ]
        if not reloads:
            out.append(f"{name(w)}: nothing has Redis re-read a renewed certificate")
        for n in reloads:
            c = next(c for c in containers(w) if c["name"] == n)
            if not mounted_key(w, c, "/etc/spotrl/tls/tls.crt"):
                out.append(f"{name(w)}/{n}: reloads a certificate it does not mount")
    return out
