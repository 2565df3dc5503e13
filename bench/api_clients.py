"""Readers of the coordinator's API for `bench/api_load.py`: N clients, each its own loopback
address (127.0.0.k, so that the coordinator's per-client limits see N clients) and its own
keep-alive HTTP/1.1 connection, written on bare asyncio streams so that the readers cost this
machine's 2 cores as little as possible.

Modes:
- `dashboard`: each client reads every GET route once a second, with If-None-Match (a browser
  tab's revalidating poll);
- `hammer`: each client reads the routes back to back, as fast as answers come; a 429 makes it
  wait the Retry-After it was given (what an HTTP client library does);
- `paced`: each client sends `--rate` reads a second (a capacity probe).

Prints one JSON line: answers by status, reads/s answered 2xx or 304, latency p50/p99 (s).

    .venv/bin/python bench/api_clients.py --url http://127.0.0.1:8100 --run-id ID \
        --mode dashboard --clients 20 --duration-s 20
"""

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from urllib.parse import urlsplit


def routes(run_id: str) -> list[str]:
    """Every GET route of the coordinator a reader polls."""
    return [
        "/v1/runs",
        f"/v1/runs/{run_id}",
        f"/v1/runs/{run_id}/metrics",
        f"/v1/runs/{run_id}/timeline?count=100",
        "/v1/workers",
        "/healthz",
        "/metrics",
        "/",
    ]


class Reader:
    """One client: one connection from its own address; ETags it was given, per path."""

    def __init__(self, host: str, port: int, address: str) -> None:
        self.host, self.port, self.address = host, port, address
        self.etags: dict[str, str] = {}
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, path: str) -> tuple[int, dict[str, str]]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(
                self.host, self.port, local_addr=(self.address, 0)
            )
        reader, writer = self.conn
        extra = f"If-None-Match: {self.etags[path]}\r\n" if path in self.etags else ""
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{extra}\r\n".encode())
        try:
            status, headers = await self._answer(reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()
            self.conn = None
            raise
        if "etag" in headers:
            self.etags[path] = headers["etag"]
        if headers.get("connection") == "close":
            writer.close()
            self.conn = None
        return status, headers

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        return status, headers


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.latencies: list[float] = []
        self.errors = 0

    def add(self, status: int, latency_s: float) -> None:
        self.statuses[status] += 1
        if status in (200, 304):
            self.latencies.append(latency_s)


async def client_loop(
    reader: Reader, paths: list[str], mode: str, rate: float, until: float, tally: Tally
) -> None:
    i = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        if mode == "dashboard":
            batch = paths
        else:
            batch = [paths[i % len(paths)]]
            i += 1
        wait_s = 0.0
        for path in batch:
            sent = time.monotonic()
            try:
                status, headers = await reader.get(path)
            except (OSError, asyncio.IncompleteReadError):
                tally.errors += 1
                await asyncio.sleep(0.1)
                continue
            tally.add(status, time.monotonic() - sent)
            if status == 429:
                wait_s = max(wait_s, float(headers.get("retry-after", "1")))
        if mode == "dashboard":
            next_at += 1.0
        elif mode == "paced":
            next_at += 1.0 / rate
        else:
            next_at = time.monotonic()
        await asyncio.sleep(max(wait_s, next_at - time.monotonic()))


async def run(args: argparse.Namespace) -> dict:
    url = urlsplit(args.url)
    paths = routes(args.run_id)
    tally = Tally()
    start = time.monotonic()
    until = start + args.duration_s
    readers = [
        Reader(url.hostname or "127.0.0.1", url.port or 80, f"127.0.{1 + k // 250}.{2 + k % 250}")
        for k in range(args.clients)
    ]
    await asyncio.gather(
        *(client_loop(r, paths, args.mode, args.rate, until, tally) for r in readers)
    )
    elapsed = time.monotonic() - start
    lat = sorted(tally.latencies)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else None

    served = tally.statuses[200] + tally.statuses[304]
    return {
        "mode": args.mode,
        "clients": args.clients,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "errors": tally.errors,
        "served_per_s": round(served / elapsed, 1),
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--mode", choices=("dashboard", "hammer", "paced"), required=True)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rate", type=float, default=10.0, help="paced: reads/s per client")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--nice", type=int, default=0, help="lower this process's priority")
    args = parser.parse_args()
    if args.nice:
        os.nice(args.nice)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
