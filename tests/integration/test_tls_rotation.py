"""Certificate rotation without downtime, with real processes: a weight store serving HTTPS (its
API under uvicorn, its block server under aiohttp) from the files of `spotrl secrets --tls`;
`spotrl secrets --renew`; without a restart, new connections get the new certificate and the
expiry gauge on /metrics follows, while a client made before (trusting the CA) keeps working.
And Redis: with the ACL file of `spotrl secrets`, the `spotrl-certs` user reloads the server's
certificate by CONFIG SET, and can touch no key."""

import re
import socket

import httpx
import pytest
import redis
from cryptography import x509

from services.cli import procs
from services.cli.main import main
from services.infra.tls import TlsFiles, ca_context, ca_verify
from tests.integration.conftest import wait_until
from tests.integration.test_tls import redis_supports_tls

pytestmark = pytest.mark.slow
GAUGE = re.compile(r"^spotrl_tls_certificate_expiry_timestamp_seconds\{[^}]*\} (\S+)$", re.M)


def served_cert(port: int, ca_file) -> x509.Certificate:
    """The certificate a new TLS connection to 127.0.0.1:`port` is shown (verified)."""
    context = ca_context(str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def secrets_folder(root, monkeypatch) -> TlsFiles:
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    out = root / "secrets"
    assert main(["secrets", str(out), "--tls", "--hosts", "127.0.0.1,localhost"]) == 0
    return TlsFiles(cert=out / "tls/tls.crt", key=out / "tls/tls.key", ca=out / "tls/ca.crt")


def start_https_store(tmp_path, files: TlsFiles, **env: str) -> tuple[procs.Proc, int]:
    """A weight store serving HTTPS from `files`, re-reading them every second."""
    port = procs.free_port()
    env = {
        "SPOTRL_PORT": str(port),
        "SPOTRL_ROOT": str(tmp_path / "w"),
        "SPOTRL_TLS_CERT_FILE": str(files.cert),
        "SPOTRL_TLS_KEY_FILE": str(files.key),
        "SPOTRL_TLS_CA_FILE": str(files.ca),
        "SPOTRL_TLS_RELOAD_INTERVAL_S": "1",
        **env,
    }
    store = procs.start_service(
        "weightstore", "services.weightstore.main", env, tmp_path, port, "https", files.ca
    )
    return store, port


def renew(files: TlsFiles, days: int) -> x509.Certificate:
    out = files.cert.parent.parent
    assert main(["secrets", str(out), "--renew", "--valid-days", str(days)]) == 0
    return x509.load_pem_x509_certificate(files.cert.read_bytes())


def expiry_gauge(url: str, ca_file) -> float:
    text = httpx.get(f"{url}/metrics", verify=ca_verify(ca_file)).text
    (value,) = GAUGE.findall(text)
    return float(value)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path, monkeypatch):
    files = secrets_folder(tmp_path, monkeypatch)
    first = x509.load_pem_x509_certificate(files.cert.read_bytes())
    # the renewed one (30 days) is within the warning's 45 days, the first not
    store, port = start_https_store(tmp_path, files, SPOTRL_TLS_WARN_DAYS="45")
    try:
        procs.wait_healthy([store], 60)
        block_port = httpx.get(f"{store.url}/v1/blocks", verify=ca_verify(files.ca)).json()["port"]
        assert served_cert(port, files.ca).serial_number == first.serial_number
        assert served_cert(block_port, files.ca).serial_number == first.serial_number
        assert expiry_gauge(store.url, files.ca) == first.not_valid_after_utc.timestamp()
        assert "expires" not in store.log_tail(200)
        old_client = httpx.Client(verify=ca_verify(files.ca), timeout=10)
        assert old_client.get(f"{store.url}/healthz").status_code == 200

        second = renew(files, 30)
        wait_until(
            lambda: served_cert(port, files.ca).serial_number == second.serial_number,
            "the API never served the renewed certificate",
            30.0,
            0.2,
        )
        assert served_cert(block_port, files.ca).serial_number == second.serial_number
        assert expiry_gauge(store.url, files.ca) == second.not_valid_after_utc.timestamp()
        assert old_client.get(f"{store.url}/healthz").status_code == 200
        fresh = httpx.Client(verify=ca_verify(files.ca), timeout=10)
        assert fresh.get(f"{store.url}/healthz").status_code == 200
        log = store.log_tail(200)
        assert f"reloaded: serial {second.serial_number:x}" in log
        assert "expires" in log and "renew it" in log  # within SPOTRL_TLS_WARN_DAYS
        old_client.close()
        fresh.close()
    finally:
        store.stop()


def test_a_key_that_is_not_the_certificates_is_refused_and_the_old_pair_kept(tmp_path, monkeypatch):
    files = secrets_folder(tmp_path, monkeypatch)
    first = x509.load_pem_x509_certificate(files.cert.read_bytes())
    store, port = start_https_store(tmp_path, files, SPOTRL_SERVE_BLOCKS="false")
    try:
        procs.wait_healthy([store], 60)
        good_key = files.key.read_bytes()
        renew(files, 30)
        files.key.write_bytes(good_key)  # the old key with the new certificate
        wait_until(
            lambda: "TLS certificate not reloaded" in store.log_tail(200),
            "a mismatched pair was never refused",
            30.0,
            0.2,
        )
        assert served_cert(port, files.ca).serial_number == first.serial_number
        assert httpx.get(f"{store.url}/healthz", verify=ca_verify(files.ca)).status_code == 200
    finally:
        store.stop()


def test_the_certs_user_reloads_redis_and_touches_no_key(tmp_path, monkeypatch):
    if not redis_supports_tls():
        pytest.skip("this redis-server has no TLS (the Redis 6.2 fallback)")
    files = secrets_folder(tmp_path, monkeypatch)
    out = files.cert.parent.parent
    env = dict(line.split("=", 1) for line in (out / "redis.env").read_text().splitlines())
    proc, url = procs.start_redis(
        tmp_path / "logs", tmp_path / "data", aclfile=out / "redis/users.acl", tls=files
    )
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        first = served_cert(port, files.ca)
        certs_user = redis.Redis(
            port=port,
            username=env["SPOTRL_CERTS_REDIS_USER"],
            password=env["SPOTRL_CERTS_REDIS_AUTH"],
            ssl=True,
            ssl_ca_certs=str(files.ca),
        )
        with certs_user:
            assert certs_user.ping()
            second = renew(files, 30)
            assert served_cert(port, files.ca).serial_number == first.serial_number  # not yet
            certs_user.execute_command(
                "CONFIG", "SET",
                "tls-cert-file", str(files.cert.resolve()),
                "tls-key-file", str(files.key.resolve()),
                "tls-ca-cert-file", str(files.ca.resolve()),
            )  # fmt: skip
            assert served_cert(port, files.ca).serial_number == second.serial_number
            for attempt in (
                lambda: certs_user.get("spotrl:run:x"),
                lambda: certs_user.set("spotrl:run:x", "1"),
                lambda: certs_user.keys("*"),
                lambda: certs_user.config_get("requirepass"),
                lambda: certs_user.acl_list(),
                lambda: certs_user.flushall(),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attempt()
    finally:
        proc.stop()
