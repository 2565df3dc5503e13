"""Weight pull speed: the weight store's verified parallel range pull vs a static file server.

Makes safetensors checkpoints of about 100 MB and 1 GB, uploads them to a weight store process,
and pulls each in the same run from (a) the weight store with `WeightClient.pull` (parallel range
requests, every sha256 verified, renamed into place) and (b) nginx serving the very same files,
fetched by curl (one stream, no verification) as the baseline. Then it measures `provision_s`:
from a new rollout worker's registration to its first generated token, with a ~1 GB model.

Prints one JSON object as its LAST line (Gb/s are gigabits per second):
pull_gbps, baseline_gbps, pull_vs_baseline (for the 1 GB checkpoint), the same per size, and
provision_s.

    apt-get install nginx-light curl   # the baseline's server and client
    .venv/bin/python bench/weight_pull.py [--repeat 3] [--no-provision]
"""

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from services.cli import procs
from services.common.weights import WeightClient

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


def provision_seconds(work: Path) -> float:
    """Registration of a new worker -> its first token, for a ~1 GB model."""
    import redis
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from services.cli.client import CoordinatorClient
    from services.cli.local_deployment import DeploymentConfig
    from services.cli.local_deployment import LocalDeployment as Deployment
    from services.cli.up import ensure_model
    from services.common import keys
    from services.common.messages import DeltaBatch

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-provision", action="store_true")
    args = parser.parse_args()
    if not shutil.which("nginx") or not shutil.which("curl"):
        raise SystemExit("the baseline needs nginx and curl: apt-get install nginx-light curl")
    work = Path(tempfile.mkdtemp(prefix="spotrl-bench-pull-"))
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
    provision = None if args.no_provision else provision_seconds(work)
    big = results["ckpt1g"]
    print(
        json.dumps(
            {
                "pull_gbps": big["pull_gbps"],
                "baseline_gbps": big["baseline_gbps"],
                "pull_vs_baseline": big["pull_vs_baseline"],
                "provision_s": provision,
                "sizes": results,
            }
        )
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
