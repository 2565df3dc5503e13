"""The TLS files of a `spotrl secrets` folder: the kept CA (`ca/ca.crt`, `ca/ca.key`) and what
the services mount (`tls/ca.crt`, `tls/tls.crt`, `tls/tls.key`); writing them, and renewing the
server certificate with the kept CA (`spotrl secrets DIR --renew`).

The CA's key never goes into `tls/`: a service that mounts `tls/` can serve, not sign. A renewal
writes a new key and certificate for the same hosts (read back from the current certificate),
each by a rename, the key first; it touches no token, password or ACL. It does not reach a
service: those re-read their files (`services.infra.tls_reload`).
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from services.cli.private_files import make_private_dir, write_private_bytes

if TYPE_CHECKING:  # cryptography: only when a command makes or renews certificates
    from cryptography import x509

TLS_DIR = Path("tls")  # what the services mount
TLS_NAMES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
CA_DIR = Path("ca")  # the kept CA: mounted by no service
CA_CERT = CA_DIR / "ca.crt"
CA_KEY = CA_DIR / "ca.key"
# the lifetimes of a kept CA and of the certificates it signs (days): default and most
SERVER_VALID_DAYS = 365
MAX_SERVER_VALID_DAYS = 825
CA_VALID_DAYS = 3650
MAX_CA_VALID_DAYS = 36500


class RenewRefused(RuntimeError):
    """The folder cannot be renewed as it is (the message says why, in one line)."""


@dataclass(frozen=True)
class Renewed:
    """A renewal done: the certificate written, the hosts it names, its expiry and serial."""

    cert: Path
    hosts: tuple[str, ...]
    not_after: datetime
    serial: int


def write_tls(
    out: Path,
    hosts: tuple[str, ...],
    valid_days: int = SERVER_VALID_DAYS,
    ca_valid_days: int = CA_VALID_DAYS,
) -> list[Path]:
    """A new CA (kept in `out/ca/`) and a certificate for `hosts` (in `out/tls/`, with the CA's
    certificate the services trust); the paths written."""
    if valid_days > ca_valid_days:
        raise ValueError("--valid-days: longer than the CA's own life (--ca-valid-days)")
    from services.cli import certs

    ca = certs.make_ca(ca_valid_days)
    make_private_dir(out / CA_DIR)
    certs.write_key(out / CA_KEY, ca.key)
    write_private_bytes(out / CA_CERT, certs.cert_pem(ca.cert))
    folder = out / TLS_DIR
    make_private_dir(folder)
    write_private_bytes(folder / TLS_NAMES["ca"], certs.cert_pem(ca.cert))
    cert, key = certs.sign_server(ca, hosts, valid_days)
    write_pair(folder, cert, key)
    return [out / CA_CERT, out / CA_KEY, *(folder / name for name in TLS_NAMES.values())]


def renew_tls(out: Path, valid_days: int = SERVER_VALID_DAYS) -> Renewed:
    """A new key and certificate in `out/tls/` for the hosts of the current one, signed by the
    kept CA. RenewRefused when the CA's key is missing or is not the one of `tls/ca.crt`."""
    from cryptography import x509

    from services.cli import certs

    folder = out / TLS_DIR
    current = folder / TLS_NAMES["cert"]
    for needed in (out / CA_KEY, out / CA_CERT, folder / TLS_NAMES["ca"], current):
        if not needed.exists():
            raise RenewRefused(
                f"{needed} is missing: only a folder of `spotrl secrets --tls` that kept its CA "
                "can be renewed (else make a new CA: spotrl secrets DIR --tls --hosts ... --force)"
            )
    try:
        ca = certs.load_authority(out / CA_CERT, out / CA_KEY)
    except (certs.CaMismatch, ValueError) as exc:
        raise RenewRefused(f"the kept CA cannot sign: {exc}") from exc
    trusted = x509.load_pem_x509_certificates((folder / TLS_NAMES["ca"]).read_bytes())
    if not any(certs.same_key(c, ca.key) for c in trusted):
        raise RenewRefused(
            f"{out / CA_KEY} does not match {folder / TLS_NAMES['ca']}: the services would not "
            "trust what it signs"
        )
    if valid_days * 86400 > (ca.cert.not_valid_after_utc - _now()).total_seconds():
        raise RenewRefused(f"the CA expires {ca.cert.not_valid_after_utc:%Y-%m-%d}, before that")
    hosts = certs.hosts_of(x509.load_pem_x509_certificate(current.read_bytes()))
    cert, key = certs.sign_server(ca, hosts, valid_days)
    write_pair(folder, cert, key)
    return Renewed(current, hosts, cert.not_valid_after_utc, cert.serial_number)


def write_pair(folder: Path, cert: "x509.Certificate", key) -> None:
    """`tls.key` and `tls.crt`, each written whole under a temporary name and renamed over the
    old one (a reader never sees half a file), the key first: a reader between the two renames
    sees a pair that does not match and keeps what it serves (tls_reload)."""
    from services.cli import certs

    key_path, cert_path = folder / TLS_NAMES["key"], folder / TLS_NAMES["cert"]
    key_tmp, cert_tmp = key_path.with_name(".tls.key.new"), cert_path.with_name(".tls.crt.new")
    write_private_bytes(key_tmp, certs.key_pem(key))
    write_private_bytes(cert_tmp, certs.cert_pem(cert))
    key_tmp.replace(key_path)
    cert_tmp.replace(cert_path)


def _now() -> datetime:
    return datetime.now(UTC)
