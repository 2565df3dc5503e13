"""TLS for every hop, switched on by settings: a service with `tls_cert_file` and `tls_key_file`
serves HTTPS (its API under uvicorn, a block/peer server under aiohttp); a client with
`tls_ca_file` verifies https:// and rediss:// peers against that CA instead of the system's
trust store. Nothing here makes certificates (`services.cli.certs` does); a served certificate
follows its files (`services.infra.tls_reload`), and so does a CA file clients trust.

With no TLS setting, everything stays plain HTTP, as on one machine's loopback; a service bound
off loopback without a certificate says so in one warning line at start (`warn_if_plain`).
"""

import functools
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from services.infra.settings import is_loopback

if TYPE_CHECKING:
    from services.infra.settings import CommonSettings

log = logging.getLogger(__name__)
# every service's /metrics adds this registry (services.infra.service); no sample until a
# certificate is served (tls_reload sets it at start and at each reload)
EXPIRY_REGISTRY = CollectorRegistry()
CERT_EXPIRY = Gauge(
    "spotrl_tls_certificate_expiry_timestamp_seconds",
    "When the certificate this process serves expires (its notAfter, unix seconds)",
    ["cert_file"],
    registry=EXPIRY_REGISTRY,
)


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key, and the CA that signed it (what clients verify with)."""

    cert: Path
    key: Path
    ca: Path


def enabled(settings: "CommonSettings") -> bool:
    """Whether this service serves HTTPS (its settings name a certificate and its key)."""
    return settings.tls_cert_file is not None and settings.tls_key_file is not None


def scheme(settings: "CommonSettings") -> str:
    """The scheme of the URLs this service's servers answer on: 'https' or 'http'."""
    return "https" if enabled(settings) else "http"


def expiry_metrics() -> bytes:
    """The expiry gauge in Prometheus text (its HELP and TYPE alone while none is served)."""
    return generate_latest(EXPIRY_REGISTRY)


def uvicorn_args(settings: "CommonSettings") -> dict[str, Any]:
    """The keyword arguments that make `uvicorn.Config` serve HTTPS ({}: plain HTTP)."""
    if not enabled(settings):
        return {}
    return {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}


_CA_CONTEXTS: dict[str, tuple[tuple[int, int, int], ssl.SSLContext]] = {}
_CA_LOCK = threading.Lock()


def ca_context(ca_file: str) -> ssl.SSLContext:
    """A client context that trusts `ca_file`: one per file and process, shared by every client
    and thread (building one costs milliseconds). When the file changed since, its certificates
    are added to that same context, so clients made before trust them too: a CA rotation puts
    the new CA into the bundle first. A CA taken out of the file stays trusted until a restart."""
    stamp = _stamp(ca_file)
    with _CA_LOCK:
        known = _CA_CONTEXTS.get(ca_file)
        if known is None:
            context = ssl.create_default_context(cafile=ca_file)
        else:
            context = known[1]
            if known[0] != stamp:
                context.load_verify_locations(cafile=ca_file)
                log.info("CA file %s re-read", ca_file)
        _CA_CONTEXTS[ca_file] = (stamp, context)
        return context


def refresh_ca_contexts() -> None:
    """Re-read each CA file a client context was made of, where it changed."""
    for ca_file in list(_CA_CONTEXTS):
        try:
            ca_context(ca_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("CA file %s not re-read, still trusting what it held: %s", ca_file, exc)


def _stamp(path: str) -> tuple[int, int, int]:
    """What changes when a file is rewritten or replaced (a Secret's symlink swapped)."""
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def ca_verify(ca_file: Path | str | None) -> ssl.SSLContext | bool:
    """What httpx's `verify=` takes: a context trusting `ca_file`, or True (the system's)."""
    return ca_context(str(ca_file)) if ca_file else True


def client_verify(settings: "CommonSettings") -> ssl.SSLContext | bool:
    """httpx's `verify=` for this process's clients (`tls_ca_file`, or the system's CAs)."""
    return ca_verify(settings.tls_ca_file)


def client_context(ca_file: Path | str | None) -> ssl.SSLContext:
    """An SSLContext for clients that take no `True` (the stdlib's http.client)."""
    return ca_context(str(ca_file)) if ca_file else system_context()


@functools.cache
def system_context() -> ssl.SSLContext:
    """A client context that trusts the system's CAs, once per process."""
    return ssl.create_default_context()


def warn_if_plain(settings: "CommonSettings", service: str) -> bool:
    """One warning line when this service is reachable off loopback and serves plain HTTP: its
    bearer token, weights and prompts would cross the network readable. True when it warned."""
    if enabled(settings) or is_loopback(settings.host):
        return False
    log.warning(
        "%s serves plain HTTP on %s, off loopback: set SPOTRL_TLS_CERT_FILE and "
        "SPOTRL_TLS_KEY_FILE to serve HTTPS",
        service,
        settings.host,
    )
    return True
