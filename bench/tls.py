"""The cost of TLS (issue 41): delta ingest and a weight pull with TLS off and on, side by side
in one run, on the same machine, one after the other.

(a) Delta ingest, as `bench/coordinator.py --collect-only` measures it: the coordinator's own
DeltaCollector in this process takes pre-flushed deltas from a real Redis, once over plain
`redis://` and once over `rediss://` (a redis-server with only a TLS port, certificate from a
throwaway CA, `services.cli.certs`). Ingest is serial on that path (Redis answers a read, the
collector decodes it), so `ingest_tokens_s` is the tokens over the CPU-seconds of both, the
collector's thread and Redis's, inside the reads. TLS costs on both sides: Redis encrypts what
it answers, the collector's event loop decrypts it. With `--ingest run` it is instead a whole
run of `bench/coordinator.py` (synthetic workers, the coordinator and the trainer loop as real
processes, the workers and everyone else reaching Redis over TLS), its `tok_s`.

(b) A weight pull: one version of `--pull-mb` MB of random bytes, uploaded to a weight store
over HTTP and to one over HTTPS, and pulled with `WeightClient.pull` (parallel range requests
to the store's block server, every block's sha256 verified): `--repeat` pulls each, the best
kept. Over HTTP the block server answers with sendfile (no byte through Python); over HTTPS it
cannot (the kernel does not encrypt), and the client decrypts in its threads.

Prints progress to stderr and, as its LAST stdout line, one JSON object:
ingest_tokens_s_plain, ingest_tokens_s_tls, ingest_ratio (tls / plain), pull_MBps_plain,
pull_MBps_tls, pull_ratio (tls / plain).

    .venv/bin/python bench/tls.py [--pull-mb 256] [--repeat 3] [--rounds 32] [--ingest run]
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import coordinator as ingest_bench
from services.cli import procs
from services.cli.certs import make_certs
from services.infra.logs import setup_logging
from services.infra.tls import TlsFiles
from services.weights.transfer import WeightClient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ingest", choices=("collect", "run"), default="collect")
    p.add_argument("--rounds", type=int, default=32, help="collect: flushes per request")
    p.add_argument("--workers", type=int, default=4, help="collect: streams' writers; run: workers")
    p.add_argument("--slots", type=int, default=2048, help="requests per worker")
    p.add_argument("--tokens-per-flush", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="run: steps")
    p.add_argument("--prompts", type=int, default=1024, help="run: prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=256, help="run: longest response")
    p.add_argument("--pull-mb", type=int, default=256, help="size of the version pulled")
    p.add_argument("--repeat", type=int, default=3, help="pulls each way; the best is kept")
    p.add_argument("--work-dir", type=Path, help="keep logs and data here (default: temp dir)")
    return p.parse_args(argv)


# ---- a Redis that speaks only TLS ----
def start_tls_redis(files: TlsFiles, log_dir: Path, data_dir: Path) -> tuple[procs.Proc, str]:
    """A redis-server (append-only file on, as `procs.start_redis` in the ingest bench) with no
    plain port and a TLS port; the URL carries the CA (redis-py reads `ssl_ca_certs` from its
    query), so every process given it, the coordinator and the workers too, verifies Redis."""
    port = procs.free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [
        procs.redis_server_binary(),
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
        *("--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key)),
        *("--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "no"),
        *("--save", "", "--appendonly", "yes", "--dir", str(data_dir.resolve())),
        *("--maxmemory", "0mb", "--maxmemory-policy", "noeviction"),
    ]
    proc = procs.start("redis-tls", args, {}, log_dir)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files.ca}"
    import redis

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"redis-server exited:\n{proc.log_tail()}")
        with contextlib.suppress(redis.ConnectionError), redis.Redis.from_url(url) as r:
            if r.ping():
                return proc, url
        time.sleep(0.05)
    raise TimeoutError("redis-server over TLS did not start")


@contextlib.contextmanager
def redis_over_tls(files: TlsFiles) -> Iterator[None]:
    """While inside, the ingest bench's `procs.start_redis` starts the TLS Redis instead."""
    plain = procs.start_redis

    def start(log_dir: Path, data_dir: Path, **_: object) -> tuple[procs.Proc, str]:
        return start_tls_redis(files, log_dir, data_dir)

    procs.start_redis = start  # type: ignore[assignment]
    try:
        yield
    finally:
        procs.start_redis = plain


# ---- (a) ingest ----
def ingest_args(args: argparse.Namespace, work: Path) -> argparse.Namespace:
    argv = [
        *("--workers", str(args.workers), "--slots", str(args.slots)),
        *("--tokens-per-flush", str(args.tokens_per_flush), "--rounds", str(args.rounds)),
        *("--steps", str(args.steps), "--prompts", str(args.prompts)),
        *("--max-new-tokens", str(args.max_new_tokens), "--kill-step", "-1"),
        *("--work-dir", str(work)),
    ]
    if args.ingest == "collect":
        argv.append("--collect-only")
    return ingest_bench.parse_args(argv)


def ingest(args: argparse.Namespace, work: Path, files: TlsFiles | None) -> dict:
    """One ingest measurement, over TLS when `files` are given."""
    work.mkdir(parents=True)
    bench_args = ingest_args(args, work)
    with redis_over_tls(files) if files is not None else contextlib.nullcontext():
        if args.ingest == "collect":
            found = ingest_bench.run_collect_only(bench_args, work)
            per_item_us = found["coordinator_us_per_item"] + found["redis_us_per_item"]
            found["ingest_tokens_s"] = round(args.tokens_per_flush * 1e6 / per_item_us)
        else:
            found = ingest_bench.run_bench(bench_args, work)
            found["ingest_tokens_s"] = found["tok_s"]
    return found


# ---- (b) pull ----
def start_store(root: Path, files: TlsFiles | None) -> procs.Proc:
    port = procs.free_port()
    env = procs.thread_env(1) | {"SPOTRL_PORT": str(port), "SPOTRL_ROOT": str(root / "data")}
    if files is None:
        proc = procs.start_service("ws-plain", "services.weightstore.main", env, root, port)
    else:
        env |= {
            "SPOTRL_TLS_CERT_FILE": str(files.cert),
            "SPOTRL_TLS_KEY_FILE": str(files.key),
            "SPOTRL_TLS_CA_FILE": str(files.ca),
        }
        proc = procs.start_service(
            "ws-tls", "services.weightstore.main", env, root, port, "https", files.ca
        )
    procs.wait_healthy([proc], 60)
    return proc


def pull_mbps(src: Path, root: Path, files: TlsFiles | None, repeat: int) -> dict:
    """The best of `repeat` pulls of the version in `src` from a store of its own."""
    store = start_store(root, files)
    try:
        assert store.url is not None
        client = WeightClient([store.url], parallel=8, ca_file=files.ca if files else None)
        asyncio.run(client.upload_folder(src, "bench", 0))
        seconds = []
        for i in range(repeat):
            dest = root / f"pull-{i}"
            result = asyncio.run(client.pull("bench", 0, dest))
            seconds.append(result.seconds)
            nbytes = result.bytes
            shutil.rmtree(dest)
            rate = nbytes / result.seconds / 1e6
            scheme = "https" if files else "http"
            print(f"pull {scheme} #{i}: {rate:.0f} MB/s", file=sys.stderr, flush=True)
        source = client._block_sources.get(store.url, store.url)
    finally:
        store.stop()
    return {"MBps": round(nbytes / min(seconds) / 1e6, 1), "bytes": nbytes, "source": source}


def make_version(folder: Path, megabytes: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as f:
        for _ in range(megabytes):
            f.write(os.urandom(1024 * 1024))
    return folder


def run(args: argparse.Namespace, work: Path) -> dict:
    files = make_certs(work / "certs")
    sides: dict[str, dict] = {}
    for name, tls in (("plain", None), ("tls", files)):
        print(f"ingest over {name} Redis ...", file=sys.stderr, flush=True)
        sides[f"ingest_{name}"] = ingest(args, work / f"ingest-{name}", tls)
    src = make_version(work / "version", args.pull_mb)
    for name, tls in (("plain", None), ("tls", files)):
        sides[f"pull_{name}"] = pull_mbps(src, work / f"pull-{name}", tls, args.repeat)
    plain, tls_on = sides["ingest_plain"], sides["ingest_tls"]
    pull_plain, pull_tls = sides["pull_plain"]["MBps"], sides["pull_tls"]["MBps"]
    return {
        "ingest_mode": args.ingest,
        "details": sides,
        "ingest_tokens_s_plain": plain["ingest_tokens_s"],
        "ingest_tokens_s_tls": tls_on["ingest_tokens_s"],
        "ingest_ratio": round(tls_on["ingest_tokens_s"] / plain["ingest_tokens_s"], 3),
        "pull_MBps_plain": pull_plain,
        "pull_MBps_tls": pull_tls,
        "pull_ratio": round(pull_tls / pull_plain, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging("bench", "WARNING")
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        summary = run(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="spotrl-tls-") as tmp:
            summary = run(args, Path(tmp))
    details = summary.pop("details")
    print(json.dumps(details), file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
