"""Slow-body clients for `bench/slow_clients.py`: N connections from one process on bare asyncio
sockets, each from one of `--sources` (loopback addresses, in turn), each sending the headers of
a POST with a body of `--declared-bytes` at once, then one byte of that body every `--pace-s`,
until the server closes it; then it connects again, until `--duration-s` is over. Connections
open then are followed until the server closes them (or `--give-up-s` after they opened).

For each connection: how long it stayed open and how many bytes it sent; one the server closed
within `--refused-s` of its opening, before a byte of answer, counts as refused at once (the
per-client cap), any other as cut off (a timeout). Its limit is the body's:
`--body-timeout-s` + its bytes over `--min-rate`.

Prints one JSON line: connections, refused, cut off, never closed, connect errors, the time cut
ones stayed open (p50, max) and the most any was open past its limit.

    .venv/bin/python bench/slow_attack.py --url http://127.0.0.1:8100 --sources 127.0.0.2 \
        --connections 1000 --duration-s 60
"""

import argparse
import asyncio
import json
import resource
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Tally:
    refused: int = 0
    connect_errors: int = 0
    never_closed: int = 0
    open_s: list[float] = field(default_factory=list)  # of the cut off ones
    late_s: list[float] = field(default_factory=list)  # open past the limit (<= 0: in time)
    connect_s: list[float] = field(default_factory=list)  # from connect() to connected


@dataclass(frozen=True)
class Attack:
    host: str
    port: int
    head: bytes
    pace_s: float
    refused_s: float
    give_up_s: float
    body_timeout_s: float
    min_rate: float


async def one(attack: Attack, source: str, tally: Tally) -> None:
    """One connection, from opening to its close."""
    opened = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(
            attack.host, attack.port, local_addr=(source, 0)
        )
    except OSError:
        tally.connect_errors += 1
        await asyncio.sleep(attack.pace_s)
        return
    tally.connect_s.append(time.monotonic() - opened)
    writer.write(attack.head)
    sent, answered = len(attack.head), 0
    closed = asyncio.ensure_future(reader.read())  # to the end: the server's close
    while not closed.done():
        if time.monotonic() - opened > attack.give_up_s:
            tally.never_closed += 1
            closed.cancel()
            break
        done, _ = await asyncio.wait([closed], timeout=attack.pace_s)
        if not done and not writer.is_closing():
            writer.write(b" ")
            sent += 1
    open_s = time.monotonic() - opened
    if closed.done() and not closed.cancelled() and closed.exception() is None:
        answered = len(closed.result())
    writer.close()
    if closed.cancelled():
        return
    if open_s < attack.refused_s and not answered:
        tally.refused += 1
        await asyncio.sleep(attack.pace_s)  # what a client refused does: try again later
        return
    tally.open_s.append(open_s)
    tally.late_s.append(open_s - attack.body_timeout_s - sent / attack.min_rate)


async def slot(attack: Attack, source: str, until: float, tally: Tally) -> None:
    """One of the N: connects again each time it is closed, until `until`."""
    while time.monotonic() < until:
        await one(attack, source, tally)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else 0.0


async def run(args: argparse.Namespace) -> dict:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    head = (
        f"POST {args.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {args.declared_bytes}\r\n\r\n"
    ).encode()
    attack = Attack(
        host, port, head, args.pace_s, args.refused_s, args.give_up_s,
        args.body_timeout_s, args.min_rate,
    )  # fmt: skip
    sources = args.sources.split(",")
    tally = Tally()
    until = time.monotonic() + args.duration_s
    started = time.monotonic()
    await asyncio.gather(
        *(slot(attack, sources[i % len(sources)], until, tally) for i in range(args.connections))
    )
    cut = len(tally.open_s)
    return {
        "connections": cut + tally.refused + tally.never_closed,
        "refused_at_once": tally.refused,
        "cut_off": cut,
        "never_closed": tally.never_closed,
        "connect_errors": tally.connect_errors,
        "open_s_p50": quantile(tally.open_s, 0.5),
        "open_s_max": round(max(tally.open_s, default=0.0), 3),
        "late_s_max": round(max(tally.late_s, default=0.0), 3),
        "late_s_p99": quantile(tally.late_s, 0.99),
        "connect_s_max": round(max(tally.connect_s, default=0.0), 3),
        "sources": len(sources),
        "slots": args.connections,
        "took_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", default="/v1/runs")
    parser.add_argument("--sources", default="127.0.0.2", help="comma list of source addresses")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--pace-s", type=float, default=1.0)
    parser.add_argument("--declared-bytes", type=int, default=60_000)
    parser.add_argument("--refused-s", type=float, default=1.0)
    parser.add_argument("--body-timeout-s", type=float, default=30.0)
    parser.add_argument("--min-rate", type=float, default=64 * 1024)
    parser.add_argument("--give-up-s", type=float, default=90.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.connections + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
