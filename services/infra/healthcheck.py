"""`python -m services.infra.healthcheck`: exit 0 when this container's own service is healthy.

With `SPOTRL_PORT_FILE` set, the service wrote the port it bound and its instance id there
(`service.serve`): the check probes that port and accepts only an answer from that instance. A
replica that could not bind (its port taken by another) wrote no file and is unhealthy, never
healthy by another process answering on the port it was told. Without the file setting it probes
`SPOTRL_PORT`. A service with a certificate (`SPOTRL_TLS_CERT_FILE`) is probed over HTTPS,
its certificate checked against `SPOTRL_TLS_CA_FILE` when that is set. Standard library only: it
runs every few seconds in each container.
"""

import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 2.0


def target(env: dict[str, str]) -> tuple[int, str | None]:
    """(port, instance expected or None) from the environment; ValueError when unknown."""
    port_file = env.get("SPOTRL_PORT_FILE")
    if port_file:
        try:
            found = json.loads(Path(port_file).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"no port file {port_file}: the service has not bound its port"
            ) from exc
        return int(found["port"]), str(found["instance"])
    if not env.get("SPOTRL_PORT"):
        raise ValueError("neither SPOTRL_PORT_FILE nor SPOTRL_PORT is set")
    return int(env["SPOTRL_PORT"]), None


def check(env: dict[str, str]) -> str:
    """'' when healthy, else why not."""
    try:
        port, instance = target(env)
    except (ValueError, KeyError) as exc:
        return str(exc)
    scheme = "https" if env.get("SPOTRL_TLS_CERT_FILE") else "http"
    url = f"{scheme}://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=probe_context(env)) as resp:
            body = json.loads(resp.read(64 * 1024))
    except (OSError, ValueError) as exc:  # refused, timed out, a 503 (HTTPError), not JSON
        return f"{url}: {exc}"
    if instance is not None and body.get("instance") != instance:
        return f"{url} is answered by another process (instance {body.get('instance')!r})"
    return ""


def probe_context(env: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of a probe of an HTTPS service (None for plain HTTP). The probe dials
    127.0.0.1, which the certificate need not name (it names the host others reach the
    service by): the chain is checked against the CA when one is set, the name is not; the
    probe carries no credential, and the instance id tells this process from another."""
    if not env.get("SPOTRL_TLS_CERT_FILE"):
        return None
    ca_file = env.get("SPOTRL_TLS_CA_FILE")
    context = ssl.create_default_context(cafile=ca_file or None)
    context.check_hostname = False
    if not ca_file:
        context.verify_mode = ssl.CERT_NONE  # a private CA the probe was not told of
    return context


def main() -> int:
    problem = check(dict(os.environ))
    if problem:
        print(f"unhealthy: {problem}"[:300], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
