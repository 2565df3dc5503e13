"""A deployment's kept CA (`spotrl secrets --tls`) and the renewal of its certificate
(`spotrl secrets --renew`, services/cli/tls_folder.py): the lifetime the operator sets, a CA kept
apart from what services mount, a renewal that keeps the hosts and touches nothing else, and
refusals that say why in one line. The `spotrl-certs` Redis user is in the files it writes."""

import datetime
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from services.cli import certs
from services.cli.main import main
from services.cli.tls_folder import CA_VALID_DAYS, SERVER_VALID_DAYS

HOSTS = "10.254.0.10,spot1,spot2.internal"


def spotrl_secrets(*args) -> int:
    return main(["secrets", *map(str, args)])


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def days_left(cert: x509.Certificate) -> float:
    return (cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).total_seconds() / 86400


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    folder = tmp_path / "secrets"
    assert spotrl_secrets(folder, "--tls", "--hosts", HOSTS, "--valid-days", 90) == 0
    return folder


def test_the_lifetime_is_the_operators_and_the_ca_is_kept_apart(out):
    cert, ca = load(out / "tls/tls.crt"), load(out / "ca/ca.crt")
    assert 89 < days_left(cert) <= 90
    assert CA_VALID_DAYS - 1 < days_left(ca) <= CA_VALID_DAYS
    assert (out / "tls/ca.crt").read_bytes() == (out / "ca/ca.crt").read_bytes()
    cert.verify_directly_issued_by(ca)
    # what a service mounts holds no CA key; the CA's folder is its owner's alone
    assert sorted(p.name for p in (out / "tls").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert sorted(p.name for p in (out / "ca").iterdir()) == ["ca.crt", "ca.key"]
    for path in [out / "ca", out / "tls"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for path in [*(out / "ca").iterdir(), *(out / "tls").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_the_default_lifetime_is_a_year(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    assert spotrl_secrets(tmp_path / "s", "--tls", "--hosts", "h1") == 0
    assert SERVER_VALID_DAYS - 1 < days_left(load(tmp_path / "s/tls/tls.crt")) <= SERVER_VALID_DAYS


@pytest.mark.parametrize("days", ["0", "826", "ten"])
def test_a_lifetime_out_of_bounds_is_refused(tmp_path, days, capsys):
    with pytest.raises(SystemExit) as exc:
        spotrl_secrets(tmp_path / "s", "--tls", "--hosts", "h1", "--valid-days", days)
    assert exc.value.code == 2
    assert "--valid-days" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_renew_signs_a_new_key_for_the_same_hosts_and_changes_nothing_else(out, capsys):
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    old = load(out / "tls/tls.crt")
    assert spotrl_secrets(out, "--renew", "--valid-days", 30) == 0
    new = load(out / "tls/tls.crt")
    assert certs.hosts_of(new) == ("10.254.0.10", "spot1", "spot2.internal")
    assert new.serial_number != old.serial_number
    assert new.public_key() != old.public_key()
    assert 29 < days_left(new) <= 30
    new.verify_directly_issued_by(load(out / "tls/ca.crt"))
    changed = {p for p, data in before.items() if p.read_bytes() != data}
    assert changed == {out / "tls/tls.crt", out / "tls/tls.key"}
    assert not list(out.rglob(".*.new"))  # the temporary names are gone
    key = serialization.load_pem_private_key((out / "tls/tls.key").read_bytes(), None)
    assert certs.same_key(new, key)  # type: ignore[arg-type]
    assert stat.S_IMODE((out / "tls/tls.key").stat().st_mode) == 0o600
    err = capsys.readouterr().err
    assert f"valid until {new.not_valid_after_utc:%Y-%m-%d}" in err
    assert "Swarm" in err and "Kubernetes" in err and "create secret generic" in err


def test_renew_refuses_without_the_ca_key(out, capsys):
    (out / "ca/ca.key").unlink()
    before = (out / "tls/tls.crt").read_bytes()
    assert spotrl_secrets(out, "--renew") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ca/ca.key is missing" in err
    assert (out / "tls/tls.crt").read_bytes() == before


def test_renew_refuses_a_ca_key_the_services_do_not_trust(out, tmp_path, capsys):
    other = certs.make_ca(10)
    certs.write_key(out / "ca/ca.key", other.key)
    assert spotrl_secrets(out, "--renew") == 1
    assert "is not the key of the CA certificate" in capsys.readouterr().err
    # a CA pair of its own, but not the CA in tls/ca.crt
    (out / "ca/ca.crt").write_bytes(certs.cert_pem(other.cert))
    assert spotrl_secrets(out, "--renew") == 1
    assert "does not match" in capsys.readouterr().err


def test_renew_refuses_a_folder_without_tls_and_extra_options(tmp_path, out, capsys):
    plain = tmp_path / "plain"
    assert spotrl_secrets(plain) == 0
    assert spotrl_secrets(plain, "--renew") == 1
    assert "is missing" in capsys.readouterr().err
    assert spotrl_secrets(out, "--renew", "--hosts", "other") == 2


def test_renew_refuses_a_lifetime_past_the_cas(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPOTRL_API_TOKEN", raising=False)
    folder = tmp_path / "s"
    assert spotrl_secrets(folder, "--tls", "--hosts", "h1", "--ca-valid-days", 100) == 2
    assert "longer than the CA" in capsys.readouterr().err
    assert (
        spotrl_secrets(folder, "--tls", "--hosts", "h1", "--valid-days", 50, "--ca-valid-days", 100)
        == 0
    )
    assert spotrl_secrets(folder, "--renew", "--valid-days", 200) == 1
    assert "the CA expires" in capsys.readouterr().err


def test_the_certs_redis_user_can_only_ping_and_config_set(out):
    acl = (out / "redis/users.acl").read_text().splitlines()
    (line,) = [a for a in acl if a.startswith("user spotrl-certs ")]
    assert line.split()[4:] == ["resetkeys", "resetchannels", "-@all", "+ping", "+config|set"]
    env = dict(x.split("=", 1) for x in (out / "redis.env").read_text().splitlines())
    assert env["SPOTRL_CERTS_REDIS_USER"] == "spotrl-certs"
    digest = hashes.Hash(hashes.SHA256())
    digest.update(env["SPOTRL_CERTS_REDIS_AUTH"].encode())
    assert line.split()[3] == "#" + digest.finalize().hex()
    for service in ("coordinator", "trainer", "weightstore", "rollout", "admin"):
        assert env["SPOTRL_CERTS_REDIS_AUTH"] not in (out / f"{service}.env").read_text()
