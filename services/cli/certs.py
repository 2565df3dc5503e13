"""A deployment's own certificate authority: a CA and the one server certificate it signs for
the hosts given, written as PEM files, the keys readable by their owner only; and the renewal of
that certificate with the kept CA (`spotrl secrets --renew`).

ECDSA P-256 keys (a handshake costs a fraction of an RSA one's). `make_certs` is the throwaway
kind (`spotrl up --tls`, the tests): a week's life, for one run. `make_ca` and `sign_server` are
what `spotrl secrets --tls` keeps: a CA of years and a certificate of the operator's lifetime
(their defaults and bounds: services.cli.tls_folder).
Nothing here revokes anything or talks to a service: the services re-read the files
(`services.infra.tls_reload`).
"""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.cli.private_files import write_private_bytes
from services.infra.tls import TlsFiles

VALID_DAYS = 7  # the throwaway kind: `spotrl up --tls` and the tests
CLOCK_SKEW_S = 300  # valid from a little before now: hosts' clocks differ
CA_NAME = "spotrl deployment CA"


class CaMismatch(ValueError):
    """The CA's key is not the key of the CA certificate the services trust."""


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def make_ca(valid_days: int, name: str = CA_NAME) -> Authority:
    """A new self-signed CA that may sign server certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key(), valid_days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def sign_server(
    ca: Authority, hosts: tuple[str, ...], valid_days: int
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and a certificate for `hosts` (IP addresses and names, the first one its
    common name), signed by `ca`, valid `valid_days` from now."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        _builder(name, ca.cert.subject, key.public_key(), valid_days)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return cert, key


def make_certs(
    folder: Path,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    valid_days: int = VALID_DAYS,
) -> TlsFiles:
    """The throwaway kind: write ca.pem (a new CA's certificate; ca.key its key), server.pem and
    server.key (a certificate for `hosts`, signed by the CA) into `folder`."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host")
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca(valid_days, "spotrl throwaway CA")
    cert, key = sign_server(ca, hosts, valid_days)
    files = TlsFiles(cert=folder / "server.pem", key=folder / "server.key", ca=folder / "ca.pem")
    write_key(folder / "ca.key", ca.key)
    write_key(files.key, key)
    files.ca.write_bytes(cert_pem(ca.cert))
    files.cert.write_bytes(cert_pem(cert))
    return files


def load_authority(cert_path: Path, key_path: Path) -> Authority:
    """The CA of these files; FileNotFoundError for a missing one, CaMismatch when the key is
    not the certificate's or the certificate is no CA."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not same_key(cert, key):
        raise CaMismatch(f"{key_path} is not the key of the CA certificate {cert_path}")
    if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
        raise CaMismatch(f"{cert_path} is not a CA certificate")
    return Authority(cert, key)


def same_key(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    def raw(public) -> bytes:
        return public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    return raw(cert.public_key()) == raw(key.public_key())


def hosts_of(cert: x509.Certificate) -> tuple[str, ...]:
    """The names a certificate is for, in its SAN's order (what `sign_server` took)."""
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return tuple(str(name.value) for name in sans)


def not_after(cert: x509.Certificate) -> datetime.datetime:
    return cert.not_valid_after_utc


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    """An IP address SAN for an address, a DNS name SAN for anything else."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The key in PEM, created 0600 (never readable by others, not even for a moment)."""
    write_private_bytes(path, key_pem(key))
