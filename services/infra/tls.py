"""TLS for every hop, switched on by settings: a service with `tls_cert_file` and `tls_key_file`
serves HTTPS (its API under uvicorn, a block/peer server under aiohttp); a client with
`tls_ca_file` verifies https:// and rediss:// peers against that CA instead of the system's
trust store. Nothing here makes certificates (`services.cli.certs` does, for a throwaway CA).

With no TLS setting, everything stays plain HTTP, as on one machine's loopback; a service bound
off loopback without a certificate says so in one warning line at start (`warn_if_plain`).
"""

import functools
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.infra.settings import is_loopback

if TYPE_CHECKING:
    from services.infra.settings import CommonSettings

log = logging.getLogger(__name__)


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


def server_context(settings: "CommonSettings") -> ssl.SSLContext | None:
    """The server side of TLS (for aiohttp's block/peer servers); None: plain HTTP."""
    if not enabled(settings):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return context


def uvicorn_args(settings: "CommonSettings") -> dict[str, Any]:
    """The keyword arguments that make `uvicorn.Config` serve HTTPS ({}: plain HTTP)."""
    if not enabled(settings):
        return {}
    return {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}


@functools.cache
def ca_context(ca_file: str) -> ssl.SSLContext:
    """A client context that trusts `ca_file` (read once per process: a context is shared by
    every client and thread, and building one costs milliseconds)."""
    return ssl.create_default_context(cafile=ca_file)


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
