"""A served certificate that follows its files (services/infra/tls_reload.py) and client CA
files re-read when they change (services/infra/tls.py): real handshakes on loopback, the
expiry warning's decision as a table."""

import logging
import socket
import ssl
import threading

import pytest
from cryptography import x509

from services.cli import certs
from services.cli.tls_folder import write_pair
from services.infra import tls, tls_reload

DAY_S = 86400.0


@pytest.mark.parametrize(
    ("left_days", "warn_days", "last_warned_ago_s", "due"),
    [
        (40, 30, None, False),  # not within the window
        (20, 30, None, True),  # within it, never warned since loaded
        (20, 30, 3600, False),  # warned an hour ago
        (20, 30, DAY_S, True),  # a day since: again
        (-1, 30, None, True),  # expired already
        (1, 0, None, False),  # 0: never
    ],
)
def test_expiry_warning_due(left_days, warn_days, last_warned_ago_s, due):
    now = 1_000_000_000.0
    last = None if last_warned_ago_s is None else now - last_warned_ago_s
    assert tls_reload.expiry_warning_due(now + left_days * DAY_S, now, warn_days, last) is due


def presented_serial(server: ssl.SSLContext, ca_file) -> int:
    """The serial a client trusting `ca_file` is shown by a server with context `server`."""
    return presented_serial_with(ssl.create_default_context(cafile=str(ca_file)), server)


def test_a_context_serves_the_pair_its_files_hold_now(tmp_path, caplog):
    caplog.set_level(logging.INFO, "services.infra.tls_reload")
    ca = certs.make_ca(30)
    cert, key = certs.sign_server(ca, ("127.0.0.1",), 10)
    write_pair(tmp_path, cert, key)
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(certs.cert_pem(ca.cert))
    served = tls_reload.ServedCertificate(
        tmp_path / "tls.crt", tmp_path / "tls.key", warn_days=5, clock=lambda: 0.0
    )
    context = served.server_context()
    assert presented_serial(context, ca_file) == cert.serial_number
    assert not served.check()  # nothing changed

    renewed, new_key = certs.sign_server(ca, ("127.0.0.1",), 20)
    write_pair(tmp_path, renewed, new_key)
    assert served.check()
    assert presented_serial(context, ca_file) == renewed.serial_number  # the same context
    assert f"reloaded: serial {renewed.serial_number:x}" in caplog.text

    # a key that is not the certificate's: refused, warned once (the second look), old kept
    other, _ = certs.sign_server(ca, ("127.0.0.1",), 20)
    (tmp_path / "tls.crt").write_bytes(certs.cert_pem(other))
    caplog.clear()
    assert not served.check() and not served.check() and not served.check()
    refusals = [r for r in caplog.records if "not reloaded" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    assert presented_serial(context, ca_file) == renewed.serial_number


def test_a_client_ca_file_is_re_read_into_the_same_context(tmp_path):
    old_ca, new_ca = certs.make_ca(30), certs.make_ca(30)
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(certs.cert_pem(old_ca.cert))
    client = tls.ca_context(str(ca_file))
    cert, key = certs.sign_server(new_ca, ("127.0.0.1",), 10)
    write_pair(tmp_path, cert, key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    with pytest.raises(ssl.SSLCertVerificationError):
        presented_serial_with(client, server)
    # a CA rotation adds the new CA to the bundle first
    ca_file.write_bytes(certs.cert_pem(old_ca.cert) + certs.cert_pem(new_ca.cert))
    tls.refresh_ca_contexts()
    assert tls.ca_context(str(ca_file)) is client
    assert presented_serial_with(client, server) == cert.serial_number


def presented_serial_with(client: ssl.SSLContext, server: ssl.SSLContext) -> int:
    """One handshake on loopback; the serial the client was shown (raises what it raises)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server.wrap_socket(conn, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with (
            socket.create_connection(listener.getsockname(), timeout=5) as raw,
            client.wrap_socket(raw, server_hostname="127.0.0.1") as s,
        ):
            der = s.getpeercert(binary_form=True)
            s.sendall(b"x")
    finally:
        thread.join(5)
        listener.close()
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
