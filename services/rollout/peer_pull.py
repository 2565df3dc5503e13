"""Pull one weight version the way a rollout worker does (from the store and from the peers
that hold its blocks, every block verified), then serve it to peers until stopped: to warm a
new machine's cache before its worker starts, and what the fan-out tests and benchmark run as
"a worker without an engine".

    python -m services.rollout.peer_pull --run RUN --version V --dest DIR [--serve]

Settings (store URL, Redis, peer port, SPOTRL_P2P...) are the rollout worker's. It prints
one JSON line when the pull is done: {"version", "bytes", "from_peers", "seconds", "digest",
"started_at", "ended_at"} (the last two: Unix time).
"""

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path

from services.infra.logs import setup_logging
from services.infra.redis_streams import connect
from services.rollout.peers import Peers
from services.rollout.settings import RolloutSettings
from services.weights.transfer import WeightClient


async def pull_and_serve(
    s: RolloutSettings, run_id: str, version: int, dest: Path, serve: bool
) -> dict:
    r = connect(s.redis_url, ca_file=s.tls_ca_file)
    peers = Peers(s) if s.p2p else None
    try:
        client = WeightClient(s.weightstore_urls(), s.outgoing_token(), ca_file=s.tls_ca_file)
        swarm = peers.swarm(r, run_id, version) if peers is not None else None
        started_at = time.time()
        result = await client.pull(run_id, version, dest, swarm=swarm)
        outcome = {
            "started_at": started_at,
            "ended_at": time.time(),
            "version": result.version,
            "bytes": result.bytes,
            "from_peers": result.from_peers,
            "seconds": round(result.seconds, 3),
            "digest": result.digest,
        }
        print(json.dumps(outcome), flush=True)
        if serve:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            if peers is not None:
                await peers.forget(r, run_id, version)
        return outcome
    finally:
        if peers is not None:
            peers.stop()
        await r.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the run id (the store's model name)")
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--dest", type=Path, required=True, help="folder to pull into")
    parser.add_argument("--serve", action="store_true", help="serve it to peers until stopped")
    args = parser.parse_args()
    s = RolloutSettings()
    setup_logging("peer_pull", s.log_level)
    asyncio.run(pull_and_serve(s, args.run, args.version, args.dest, args.serve))


if __name__ == "__main__":
    main()
