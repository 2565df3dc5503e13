"""Weight pull speed: the weight store's verified parallel range pull vs a static file server,
and the fan-out of one version to many pullers, store only vs peer to peer.

Makes safetensors checkpoints of about 100 MB and 1 GB, uploads them to a weight store process,
and pulls each in the same run from (a) the weight store with `WeightClient.pull` (parallel range
requests to its zero-copy block server, every block's sha256 verified, renamed into place) and
(b) nginx serving the very same files (sendfile), fetched by curl (one stream, no verification)
as the baseline. Then it measures `provision_s`: from a new rollout worker's registration to its
first generated token, with a ~1 GB model.

With `--fanout N`: N puller processes (services.rollout.peer_pull: a worker's pull, without its
engine) fetch the 1 GB version at once, first from the store only (SPOTRL_P2P=false), then peer
to peer (the pullers serve each other the blocks they verified), side by side; the total is from
the first puller's start to the last one's end. Loopback has no egress limit of its own, so this
runs twice: uncapped, and with the store's egress capped at `--store-mbps` (a store whose NIC a
fleet shares; the pullers' own egress is not capped).

Prints one JSON object as its LAST line (Gb/s are gigabits per second):
pull_gbps, baseline_gbps, pull_vs_baseline (for the 1 GB checkpoint), the same per size,
provision_s, and with --fanout: fanout_speedup (store-only total / P2P total, store capped),
fanout_speedup_uncapped, and each run's totals.

With `--delta` (issue 42; instead of the above, needs no nginx): real versions
(bench/delta_versions.py: a `--delta-model` trained by the trainer's Policy, GRPO and AdamW at
`--lr`, as bench/delta_share.py does, each exported in bf16 by the trainer's export) uploaded
by a trainer's `WeightClient(deltas=True)` to a store whose block server's egress is capped at
`--store-mbps` (default 1000: a cross-region link), then each version pulled by two workers
side by side, alternately first: one in full
(`WeightClient(deltas=False)`, the engine reloads everything), one by deltas (the announced
manifest, the engine loads `result.changed`), each next to the folder of the version it holds,
each into a real HF engine. Pull-to-loaded = pull + `engine.load`. After each version both
folders' weight files must be the exported bytes, and at the end both engines' weights equal.
Its last line: delta_bytes_ratio (delta bytes / full
bytes), delta_speedup (mean full pull-to-loaded / mean delta), pull_speedup (pulls only),
changed_fraction (elements changed / elements, consecutive exports), bit_identical,
store_mbps, lr, model_bytes and the means behind them.

    apt-get install nginx-light curl   # the baseline's server and client
    .venv/bin/python bench/weight_pull.py [--repeat 3] [--no-provision] [--fanout 8]
    .venv/bin/python bench/weight_pull.py --delta [--versions 6 --lr 1e-6 --store-mbps 1000]
"""

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.cli import procs
from services.weights.transfer import WeightClient

NGINX_CONF = """
daemon off; worker_processes 2; pid {root}/nginx.pid; error_log {root}/nginx.err;
events {{ worker_connections 256; }}
http {{ access_log off; sendfile on; tcp_nopush on;
  server {{ listen 127.0.0.1:{port}; root {files}; }} }}
"""


def make_checkpoint(folder: Path, total_bytes: int) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    rows = total_bytes // (4 * 4096)
    save_file({"w": torch.randn(rows, 4096)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    return folder


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes * 8 / seconds / 1e9, 2)


def measure_size(name, src, store_url, nginx_url, files_dir, work, repeat) -> dict:
    client = WeightClient([store_url], parallel=8)
    asyncio.run(client.upload_folder(src, name, 0))
    nbytes = sum(p.stat().st_size for p in src.iterdir())
    served = files_dir / name / "v00000000"
    pulls, curls = [], []
    for i in range(repeat):
        dest = work / f"pull-{name}-{i}"
        pulls.append(timed(lambda d=dest: asyncio.run(client.pull(name, 0, d))))
        shutil.rmtree(dest)
        out = work / f"curl-{name}-{i}"
        out.mkdir()

        def fetch(o=out):
            for f in served.iterdir():
                if f.name != "manifest.json":
                    subprocess.run(
                        [
                            "curl",
                            "-sf",
                            "-o",
                            str(o / f.name),
                            f"{nginx_url}/{name}/v00000000/{f.name}",
                        ],
                        check=True,
                    )

        curls.append(timed(fetch))
        shutil.rmtree(out)
    pull_s, curl_s = min(pulls), min(curls)
    return {
        "bytes": nbytes,
        "pull_s": round(pull_s, 3),
        "baseline_s": round(curl_s, 3),
        "pull_gbps": gbps(nbytes, pull_s),
        "baseline_gbps": gbps(nbytes, curl_s),
        "pull_vs_baseline": round(curl_s / pull_s, 3),
    }


def fanout(store_url: str, redis_url: str, work: Path, pullers: int, p2p: bool, label: str) -> dict:
    """`pullers` processes pulling ckpt1g v0 at once; their totals."""
    from services.infra.settings import settings_env
    from services.rollout.settings import RolloutSettings

    mode = "p2p" if p2p else "store"
    procs_ = []
    for i in range(pullers):
        env = settings_env(
            RolloutSettings,
            worker_id=f"{mode}-{i}",
            redis_url=redis_url,
            weightstore_url=store_url,
            p2p=p2p,
            log_level="WARNING",
        )
        dest = work / f"fan-{mode}-{i}" / "v0"
        args = [sys.executable, "-m", "services.rollout.peer_pull", "--run", "ckpt1g"]
        args += ["--version", "0", "--dest", str(dest), "--serve"]
        procs_.append(procs.start(f"fan-{label}-{mode}-{i}", args, env, work / "logs"))
    try:
        outcomes = [wait_outcome(p) for p in procs_]
    finally:
        for p in procs_:
            p.stop()
        for i in range(pullers):
            shutil.rmtree(work / f"fan-{mode}-{i}", ignore_errors=True)
    nbytes = sum(o["bytes"] for o in outcomes)
    total = max(o["ended_at"] for o in outcomes) - min(o["started_at"] for o in outcomes)
    return {
        "total_s": round(total, 3),
        "slowest_pull_s": max(o["seconds"] for o in outcomes),
        "peer_share": round(sum(o["from_peers"] for o in outcomes) / nbytes, 3),
        "gbps_delivered": gbps(nbytes, total),
    }


def wait_outcome(proc: procs.Proc, timeout_s: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                return json.loads(line)
        if not proc.alive():
            raise procs.died(proc)
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} did not finish its pull")


def fanout_side_by_side(work: Path, files_dir: Path, pullers: int, store_mbps: float) -> dict:
    """Store-only then P2P, uncapped and with the store's egress capped."""
    redis_proc, redis_url = procs.start_redis(work / "redis-log", work / "redis")
    results: dict = {"pullers": pullers, "store_mbps": store_mbps}
    try:
        for label, cap in (("uncapped", None), ("capped", store_mbps)):
            port = procs.free_port()
            env = {"SPOTRL_PORT": str(port), "SPOTRL_ROOT": str(files_dir)}
            if cap:
                env["SPOTRL_EGRESS_MBPS"] = str(cap)
            store = procs.start_service(
                f"store-{label}", "services.weightstore.main", env, work, port
            )
            procs.wait_healthy([store])
            try:
                runs = {}
                for p2p in (False, True):
                    runs["p2p" if p2p else "store_only"] = fanout(
                        store.url, redis_url, work, pullers, p2p, label
                    )
                    print(f"fanout {label}", runs, flush=True)
            finally:
                store.stop()
            runs["speedup"] = round(runs["store_only"]["total_s"] / runs["p2p"]["total_s"], 3)
            results[label] = runs
    finally:
        redis_proc.stop()
    return results


def provision_seconds(work: Path) -> float:
    """Registration of a new worker -> its first token, for a ~1 GB model."""
    import redis
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from services.cli.client import CoordinatorClient
    from services.cli.local_deployment import DeploymentConfig
    from services.cli.local_deployment import LocalDeployment as Deployment
    from services.cli.up import ensure_model
    from services.contracts import keys
    from services.contracts.messages import DeltaBatch

    small = ensure_model(Path(".spotrl/models/arithmetic-base"), "arithmetic", None, 1000)
    tok = AutoTokenizer.from_pretrained(small)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    big = work / "big-model"
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(big)
    tok.save_pretrained(big)
    size = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    dep = Deployment(DeploymentConfig(work / "deploy", reserved=0, preemptible=0))
    dep.start()
    try:
        client = CoordinatorClient(dep.coordinator_url)
        r = redis.Redis.from_url(dep.redis_url)
        run_id = client.submit(
            {
                "model": str(big),
                "steps": 1,
                "prompts_per_step": 1,
                "group_size": 1,
                "max_new_tokens": 2,
            }
        )
        while r.get(keys.run_version(run_id)) is None:
            time.sleep(0.1)
        worker = dep.add_worker("preemptible", wait=False)
        while True:
            first = [
                DeltaBatch.from_fields(f) for entry_id, f in r.xrange(keys.deltas_stream(run_id))
            ]
            if any(b.worker_id == worker.name for b in first):
                break
            time.sleep(0.05)
        first_ms = int(r.xrange(keys.deltas_stream(run_id), count=1)[0][0].split(b"-")[0])
        registered = float(r.hget(keys.worker(worker.name), "registered_at"))
        print(f"provision: model {size / 1e9:.2f} GB")
        return round(first_ms / 1000 - registered, 2)
    finally:
        dep.stop()


# ---- --delta: full vs delta pulls of real versions (issue 42) ----
DELTA_MODEL = "policy"


class Puller:
    """One rollout worker's side: a WeightClient pulling each version next to the folder of
    the one it holds, and an HF engine loading it."""

    def __init__(self, label: str, store_url: str, work: Path, deltas: bool) -> None:
        from services.rollout.engines.hf import HFEngine

        self.label, self.work, self.deltas = label, work, deltas
        self.client = WeightClient([store_url], deltas=deltas)
        self.engine = HFEngine()
        self.held: Path | None = None

    async def pull_and_load(self, version: int, digest: str, manifest) -> dict:
        """Pull `version` (the delta side given the announced manifest), load it into the
        engine (the delta side only the tensors that changed); the seconds of each."""
        dest = self.work / f"{self.label}-v{version}"
        started = time.perf_counter()
        result = await self.client.pull(
            DELTA_MODEL,
            version,
            dest,
            expect_digest=digest,
            reuse=self.held,
            manifest=manifest if self.deltas else None,
        )
        pulled = time.perf_counter()
        changed = result.changed if self.deltas and self.held is not None else None
        await self.engine.load(dest, changed)
        loaded = time.perf_counter()
        if self.held is not None:
            shutil.rmtree(self.held)
        self.held = dest
        return {
            "bytes": result.bytes,
            "deltas": result.deltas,
            "changed_tensors": None if changed is None else len(changed),
            "pull_s": round(pulled - started, 3),
            "load_s": round(loaded - pulled, 3),
            "s": round(loaded - started, 3),
        }

    def holds(self, files: dict[str, bytes]) -> bool:
        """Whether the folder held has exactly the exported weight files' bytes."""
        from delta_versions import weight_names

        assert self.held is not None
        return all((self.held / n).read_bytes() == files[n] for n in weight_names(files))


def start_capped_store(work: Path, mbps: float) -> procs.Proc:
    port = procs.free_port()
    env = {
        "SPOTRL_PORT": str(port),
        "SPOTRL_ROOT": str(work / "store"),
        "SPOTRL_EGRESS_MBPS": str(mbps),
    }
    store = procs.start_service("weightstore-delta", "services.weightstore.main", env, work, port)
    procs.wait_healthy([store], 120)
    return store


async def delta_run(args: argparse.Namespace) -> dict:
    """Versions trained and uploaded by deltas, each pulled and loaded side by side in full
    and by deltas (alternately first) from a store whose egress is capped."""
    import torch
    from delta_versions import VersionMaker, changed_elements, model_folder, weight_names

    from services.weights.files import hash_files

    torch.set_num_threads(2)
    mbps = args.store_mbps or 1000.0
    shm = Path("/dev/shm")
    in_memory = shm.is_dir() and shutil.disk_usage(shm).free > 8e9
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-delta-", dir=shm if in_memory else None))
    store = start_capped_store(work, mbps)
    try:
        maker = VersionMaker(model_folder(args.delta_model, work / "model"), args.lr)
        trainer = WeightClient([store.url], deltas=True)
        full = Puller("full", store.url, work, deltas=False)
        delta = Puller("delta", store.url, work, deltas=True)
        rows, previous, identical = [], None, True
        for version, files in enumerate(maker.versions(args.versions)):
            local = await hash_files(files)
            manifest = await trainer.upload(local, DELTA_MODEL, version)
            row: dict = {"version": version}
            if previous is not None:
                changed, elements = changed_elements(previous, files)
                row["changed_fraction"] = round(changed / elements, 5)
            sides = (full, delta) if version % 2 else (delta, full)
            for side in sides:
                row[side.label] = await side.pull_and_load(version, local.digest, manifest)
                identical = identical and side.holds(files)
            print("delta", json.dumps(row), flush=True)
            if version:
                rows.append(row)
            previous = files
        engines_equal = same_state(full.engine, delta.engine)
        model_bytes = sum(len(files[n]) for n in weight_names(files))
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)
    return delta_summary(rows, model_bytes, identical and engines_equal, engines_equal, args) | {
        "store_mbps": mbps,
        "in_memory": in_memory,
    }


def same_state(a, b) -> bool:
    import torch

    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def delta_summary(rows: list[dict], model_bytes: int, identical: bool, engines: bool, args):
    def mean(key: str, side: str | None = None) -> float:
        values = [r[side][key] if side else r[key] for r in rows]
        return sum(values) / len(values)

    return {
        "delta_bytes_ratio": round(mean("bytes", "delta") / mean("bytes", "full"), 4),
        "delta_speedup": round(mean("s", "full") / mean("s", "delta"), 3),
        "pull_speedup": round(mean("pull_s", "full") / mean("pull_s", "delta"), 3),
        "changed_fraction": round(mean("changed_fraction"), 4),
        "bit_identical": identical,
        "engines_equal": engines,
        "lr": args.lr,
        "model": args.delta_model,
        "model_bytes": model_bytes,
        "versions": len(rows),
        "full_bytes": round(mean("bytes", "full")),
        "delta_bytes": round(mean("bytes", "delta")),
        "full_s": round(mean("s", "full"), 3),
        "delta_s": round(mean("s", "delta"), 3),
        "full_pull_s": round(mean("pull_s", "full"), 3),
        "delta_pull_s": round(mean("pull_s", "delta"), 3),
        "full_load_s": round(mean("load_s", "full"), 3),
        "delta_load_s": round(mean("load_s", "delta"), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-provision", action="store_true")
    parser.add_argument("--fanout", type=int, default=0, help="pullers of the fan-out run")
    parser.add_argument(
        "--store-mbps",
        type=float,
        default=None,
        help="the store's egress cap, megabits per second: of the fan-out's capped run "
        "(default 4000), of the --delta run (default 1000)",
    )
    parser.add_argument("--delta", action="store_true", help="full vs delta pulls (issue 42)")
    parser.add_argument("--versions", type=int, default=6, help="--delta: versions after v0")
    parser.add_argument("--lr", type=float, default=1e-6, help="--delta: AdamW learning rate")
    parser.add_argument(
        "--delta-model",
        default="qwen2-236m",
        help="--delta: a model of bench/delta_share.py's, or a model folder",
    )
    args = parser.parse_args()
    if args.delta:
        print(json.dumps(asyncio.run(delta_run(args))))
        return
    args.store_mbps = args.store_mbps or 4000.0
    if not shutil.which("nginx") or not shutil.which("curl"):
        raise SystemExit("the baseline needs nginx and curl: apt-get install nginx-light curl")
    # in memory where there is room (tmpfs), so that both sides measure the transfer, not the
    # disk's write-back (the fan-out writes N copies of the 1 GB checkpoint)
    shm = Path("/dev/shm")
    room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    in_memory = room > (args.fanout + 4) * 1.1e9
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-pull-", dir=shm if in_memory else None))
    work.chmod(0o755)  # nginx workers run as an unprivileged user
    store_port, nginx_port = procs.free_port(), procs.free_port()
    files_dir = work / "store"
    store = procs.start_service(
        "weightstore",
        "services.weightstore.main",
        {"SPOTRL_PORT": str(store_port), "SPOTRL_ROOT": str(files_dir)},
        work,
        store_port,
    )
    (work / "nginx.conf").write_text(NGINX_CONF.format(root=work, port=nginx_port, files=files_dir))
    nginx = procs.start("nginx", ["nginx", "-c", str(work / "nginx.conf")], {}, work)
    try:
        procs.wait_healthy([store])
        results = {}
        for name, size in (("ckpt100m", 100_000_000), ("ckpt1g", 1_000_000_000)):
            src = make_checkpoint(work / f"src-{name}", size)
            results[name] = measure_size(
                name, src, store.url, f"http://127.0.0.1:{nginx_port}", files_dir, work, args.repeat
            )
            print(name, results[name], flush=True)
            shutil.rmtree(src)
    finally:
        nginx.stop()
        store.stop()
    fan = fanout_side_by_side(work, files_dir, args.fanout, args.store_mbps) if args.fanout else {}
    provision = None if args.no_provision else provision_seconds(work)
    big = results["ckpt1g"]
    summary = {
        "in_memory": in_memory,
        "pull_gbps": big["pull_gbps"],
        "baseline_gbps": big["baseline_gbps"],
        "pull_vs_baseline": big["pull_vs_baseline"],
        "provision_s": provision,
        "sizes": results,
    }
    if fan:
        summary |= {
            "fanout_speedup": fan["capped"]["speedup"],
            "fanout_speedup_uncapped": fan["uncapped"]["speedup"],
            "fanout": fan,
        }
    print(json.dumps(summary))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
