"""The throwaway CA (services.cli.certs) and the TLS helpers that read its files
(services.infra.tls): a certificate that verifies for the hosts it names and no other, keys only
their owner reads, and settings that switch TLS on or leave everything as it was."""

import datetime
import ipaddress
import logging
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError

from services.cli.certs import VALID_DAYS, make_certs
from services.infra import tls, tls_reload
from services.infra.redis_streams import tls_args
from services.infra.settings import CommonSettings


def test_certificate_names_the_hosts_and_is_signed_by_the_ca(tmp_path):
    files = make_certs(tmp_path, ("127.0.0.1", "localhost", "worker-3.internal"))
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "worker-3.internal"]
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    life = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=VALID_DAYS - 1) < life <= datetime.timedelta(days=VALID_DAYS)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_keys_are_readable_by_their_owner_only(tmp_path):
    files = make_certs(tmp_path)
    for key in (files.key, tmp_path / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    files_again = make_certs(tmp_path)  # made again over the old ones: still 0600
    assert stat.S_IMODE(files_again.key.stat().st_mode) == 0o600


def handshake(files, server_name: str, ca_file) -> None:
    """One TLS handshake on loopback: a server with the certificate, a client trusting ca_file
    and expecting `server_name`; raises what the client's handshake raises."""
    settings = CommonSettings(tls_cert_file=files.cert, tls_key_file=files.key)
    server_ctx = tls_reload.server_context(settings)
    assert server_ctx is not None
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass  # the client refused us

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client_ctx = tls.client_context(ca_file)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client_ctx.wrap_socket(raw, server_hostname=server_name) as s,
        ):
            s.sendall(b"x")
    finally:
        thread.join(5)
        listener.close()


def test_a_client_with_the_ca_verifies_the_server(tmp_path):
    files = make_certs(tmp_path)
    handshake(files, "127.0.0.1", files.ca)
    handshake(files, "localhost", files.ca)


def test_a_name_the_certificate_lacks_or_another_ca_fails(tmp_path):
    files = make_certs(tmp_path / "a")
    other = make_certs(tmp_path / "b")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(files, "elsewhere.example", files.ca)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(files, "127.0.0.1", other.ca)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(files, "127.0.0.1", None)  # the system's CAs know no throwaway CA


def test_no_tls_setting_keeps_everything_plain():
    settings = CommonSettings()
    assert not tls.enabled(settings)
    assert tls.scheme(settings) == "http"
    assert tls_reload.server_context(settings) is None
    assert tls.uvicorn_args(settings) == {}
    assert tls.client_verify(settings) is True


def test_tls_settings_switch_https_on(tmp_path, monkeypatch):
    files = make_certs(tmp_path)
    monkeypatch.setenv("SPOTRL_TLS_CERT_FILE", str(files.cert))
    monkeypatch.setenv("SPOTRL_TLS_KEY_FILE", str(files.key))
    monkeypatch.setenv("SPOTRL_TLS_CA_FILE", str(files.ca))
    settings = CommonSettings()
    assert tls.scheme(settings) == "https"
    assert tls.uvicorn_args(settings) == {
        "ssl_certfile": str(files.cert),
        "ssl_keyfile": str(files.key),
    }
    verify = tls.client_verify(settings)
    assert isinstance(verify, ssl.SSLContext)
    assert verify is tls.client_verify(settings)  # read once per process


def test_a_certificate_needs_its_key(tmp_path):
    files = make_certs(tmp_path)
    with pytest.raises(ValidationError, match="together"):
        CommonSettings(tls_cert_file=files.cert)
    assert CommonSettings(tls_cert_file="", tls_key_file="").tls_cert_file is None


def test_plain_http_off_loopback_warns_once(tmp_path, caplog):
    files = make_certs(tmp_path)
    caplog.set_level(logging.WARNING, "services.infra.tls")
    assert not tls.warn_if_plain(CommonSettings(), "coordinator")
    off = CommonSettings(host="0.0.0.0", api_token="t")
    assert tls.warn_if_plain(off, "coordinator")
    with_cert = off.model_copy(update={"tls_cert_file": files.cert, "tls_key_file": files.key})
    assert not tls.warn_if_plain(with_cert, "coordinator")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "coordinator serves plain HTTP on 0.0.0.0" in lines[0]


def test_redis_takes_the_ca_for_rediss_only(tmp_path):
    assert tls_args("rediss://h:6380/0", tmp_path / "ca.pem") == {
        "ssl_ca_certs": str(tmp_path / "ca.pem")
    }
    assert tls_args("redis://h:6379/0", tmp_path / "ca.pem") == {}
    assert tls_args("rediss://h:6380/0", None) == {}
