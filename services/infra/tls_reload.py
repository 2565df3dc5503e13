"""Served certificates that follow their files: a service serving TLS re-reads its certificate
and key when they change (`spotrl secrets --renew`, a Kubernetes Secret that cert-manager
renewed) and serves the new pair to new connections, without a restart; the CA files its
clients trust are re-read too (`tls.refresh_ca_contexts`). And the expiry: a gauge that follows
each reload, and a warning line before it comes.

How a pair is swapped: every server context of this process (uvicorn's, the block and peer
servers') hands each handshake to the context of the current pair (`sni_callback`, which OpenSSL
calls at every handshake, with or without a server name). A new pair is loaded into a new
context that replaces the old one by one assignment: no context in use is changed in place,
which the block servers' threads could see half done. Connections already open keep the pair
they began with. A key that is not the certificate's, or files changing while read, keep the old
pair served: one warning, once the same files were refused twice (a renewal renames the key and
then the certificate: a check between the two sees them apart, once).

Not here: making certificates (`services.cli.certs`), Redis's own (its reloader runs CONFIG SET
as the `spotrl-certs` user).
"""

import asyncio
import hashlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509

from services.infra import tls

if TYPE_CHECKING:
    from services.infra.settings import CommonSettings

log = logging.getLogger(__name__)
WARN_EVERY_S = 86400.0  # an expiry warning, at most once a day between reloads


class PairRefused(ValueError):
    """The files are no pair to serve: missing, a key not the certificate's, changing."""


@dataclass(frozen=True)
class Pair:
    """A loaded certificate and key: the context serving them, the files' digest, when the
    certificate expires (unix seconds) and its serial."""

    context: ssl.SSLContext
    digest: str
    not_after_s: float
    serial: int


def files_digest(*paths: Path) -> str:
    """SHA-256 over the files' contents; PairRefused for one that cannot be read."""
    sha = hashlib.sha256()
    for path in paths:
        try:
            sha.update(path.read_bytes())
        except OSError as exc:
            raise PairRefused(f"{path}: {exc.strerror or exc}") from exc
        sha.update(b"\0")
    return sha.hexdigest()


def load_pair(cert: Path, key: Path) -> Pair:
    """A server context of these files. PairRefused: they do not make a pair (a key not the
    certificate's) or changed while being read."""
    before = files_digest(cert, key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert), str(key))
        parsed = x509.load_pem_x509_certificate(cert.read_bytes())
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise PairRefused(f"{cert} and {key}: {exc}") from exc
    if files_digest(cert, key) != before:
        raise PairRefused(f"{cert} and {key} changed while being read")
    return Pair(context, before, parsed.not_valid_after_utc.timestamp(), parsed.serial_number)


def expiry_warning_due(
    not_after_s: float, now_s: float, warn_days: int, last_warned_s: float | None
) -> bool:
    """Whether to warn of the expiry now: within `warn_days` of it (0: never), and not warned
    in the last day (None: not since the pair was loaded)."""
    if warn_days <= 0 or not_after_s - now_s > warn_days * 86400:
        return False
    return last_warned_s is None or now_s - last_warned_s >= WARN_EVERY_S


class ServedCertificate:
    """The certificate and key this process serves, kept current: one per pair of files and
    process (`served`); every server context it `attach`es to serves its current pair."""

    def __init__(self, cert: Path, key: Path, warn_days: int, clock: Callable[[], float]):
        self.cert, self.key = cert, key
        self.warn_days = warn_days
        self.clock = clock
        self.pair = load_pair(cert, key)  # a bad pair at start fails the start
        self.suspect: str | None = None  # files refused once (maybe between two renames)
        self.refused: str | None = None  # files refused twice, with a warning
        self.last_warned_s: float | None = None
        self._loaded("TLS certificate %s served: serial %x, valid until %s")

    def server_context(self) -> ssl.SSLContext:
        """A new server context (for one server) that serves the current pair."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.cert), str(self.key))
        return self.attach(context)

    def attach(self, context: ssl.SSLContext) -> ssl.SSLContext:
        """Make `context`'s handshakes present the current pair (its own cert is never used)."""
        context.sni_callback = self._pick
        return context

    def _pick(self, connection: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self.pair.context
        if connection.context is not current:
            connection.context = current

    def check(self) -> bool:
        """Serve the files' pair if they changed and make one; whether a new pair is served."""
        try:
            digest = files_digest(self.cert, self.key)
            if digest in (self.pair.digest, self.refused):
                return False
            pair = load_pair(self.cert, self.key)
        except PairRefused as exc:
            self._refuse(exc)
            return False
        old = self.pair
        self.pair, self.suspect, self.refused, self.last_warned_s = pair, None, None, None
        self._loaded(f"TLS certificate %s reloaded: serial %x, valid until %s (was {old.serial:x})")
        return True

    def _refuse(self, exc: PairRefused) -> None:
        try:
            digest = files_digest(self.cert, self.key)
        except PairRefused:
            digest = str(exc)
        if digest != self.suspect:
            self.suspect = digest  # a renewal between its two renames: look again next time
            return
        self.refused = digest
        log.warning(
            "TLS certificate not reloaded, still serving serial %x: %s", self.pair.serial, exc
        )

    def _loaded(self, message: str) -> None:
        tls.CERT_EXPIRY.labels(cert_file=str(self.cert)).set(self.pair.not_after_s)
        log.info(message, self.cert, self.pair.serial, _iso(self.pair.not_after_s))
        self.warn_if_expiring()

    def warn_if_expiring(self) -> bool:
        """One warning line when the pair expires within `warn_days` (at most daily)."""
        now = self.clock()
        if not expiry_warning_due(self.pair.not_after_s, now, self.warn_days, self.last_warned_s):
            return False
        self.last_warned_s = now
        log.warning(
            "TLS certificate %s expires %s, in %.1f days: renew it (spotrl secrets DIR --renew, "
            "or cert-manager); the services re-read it",
            self.cert,
            _iso(self.pair.not_after_s),
            (self.pair.not_after_s - now) / 86400,
        )
        return True

    async def watch(self, interval_s: float) -> None:
        """Check the files (and the CA files clients trust) every `interval_s`, forever."""
        while True:
            await asyncio.sleep(interval_s)
            self.check()
            self.warn_if_expiring()
            tls.refresh_ca_contexts()


_SERVED: dict[tuple[Path, Path], ServedCertificate] = {}


def served(settings: "CommonSettings") -> ServedCertificate:
    """This process's ServedCertificate of the settings' pair (made at the first call)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        raise ValueError("no TLS certificate in these settings")
    files = (settings.tls_cert_file, settings.tls_key_file)
    if files not in _SERVED:
        _SERVED[files] = ServedCertificate(*files, settings.tls_warn_days, time.time)
    return _SERVED[files]


def server_context(settings: "CommonSettings") -> ssl.SSLContext | None:
    """The server side of TLS (for aiohttp's block/peer servers), serving the certificate
    files' current pair; None: plain HTTP."""
    return served(settings).server_context() if tls.enabled(settings) else None


Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]


def watching(lifespan: Lifespan, start: Callable[[], asyncio.Task]) -> Lifespan:
    """`lifespan`, with the watcher `start()` starts running while the app runs."""

    @asynccontextmanager
    async def with_watcher(app: Any) -> AsyncIterator[Any]:
        task = start()
        try:
            async with lifespan(app) as state:
                yield state
        finally:
            task.cancel()

    return with_watcher


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
