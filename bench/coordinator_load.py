"""Synthetic rollout workers for `bench/coordinator.py`: the worker's side of the protocol with
no model, so that a real coordinator can be loaded with as many tokens as it can absorb.

A `SyntheticWorker` is one process: it registers with the coordinator over HTTP, heartbeats,
follows the active run and its committed version, reads token-level jobs of that version with
the workers' consumer group (no more than its free slots and the step's read cap), obeys its
control stream (abort: fencing; release: balancing; pause and resume), and flushes one
`DeltaBatch` per tick carrying `--tokens-per-flush` new tokens of every request it holds, at a
rate of `--tok-s` tokens per second when all its slots are busy. A request's job entry is
acknowledged once the flush that finished or released it was sent, as a real worker does.

What every response must be is fixed in advance (`TokenPlan`): token i of request `rid` is
`pool[start(rid) + i]`, its length and finish reason are drawn from its id, and a response that
stops ends with the end-of-sequence id. A continuation job (a migrated request) goes on from its
prefix; so the bench can check each trained response token by token against the plan.

It does not run an engine, pull weights (a version is "loaded" the moment it is committed) or
measure anything but what it sent; on SIGTERM it writes its counts to `--stats` as JSON.

    .venv/bin/python bench/coordinator_load.py --redis-url URL --coordinator-url URL \
        --worker-id ID --stats PATH [--slots 512 --tok-s 250000 --tokens-per-flush 4]
    .venv/bin/python bench/coordinator_load.py profiled-coordinator OUT.prof
"""

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

if not __package__:  # run as a script: bench/ is on sys.path, the repo root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.contracts import keys
from services.contracts.messages import (
    DeltaBatch,
    DeltaItem,
    FinishReason,
    Group,
    Heartbeat,
    Job,
    ReleaseReason,
    RequestLease,
    WorkerControl,
)
from services.core.collect import split_by_shard
from services.core.request_table import request_id
from services.infra.redis_streams import (
    StreamConsumer,
    connect,
    decode_or_park,
    range_entries,
    read_entries,
    with_reconnect,
)

log = logging.getLogger("coordinator_load")
POOL_SIZE = 1 << 16  # distinct starting points of a response in the token pool
LOOK_S = 0.05  # run, version, read cap and orders are looked at this often
IDLE_S = 0.05
READ_BLOCK_MS = 50


class TokenPlan:
    """Every response of a run, known in advance to the workers and to the checker alike."""

    def __init__(
        self, max_new_tokens: int, min_len: int, eos_id: int, token_ids: list[int], seed: int
    ) -> None:
        rng = random.Random(seed)
        size = POOL_SIZE + max_new_tokens
        self.tokens = [rng.choice(token_ids) for _ in range(size)]
        self.logprobs = [-4.0 * rng.random() for _ in range(size)]
        self.max_new_tokens, self.eos_id = max_new_tokens, eos_id
        self.min_len = min(min_len, max_new_tokens)

    def start(self, rid: str) -> int:
        return zlib.crc32(rid.encode()) % POOL_SIZE

    def length(self, rid: str) -> tuple[int, FinishReason]:
        """The response's length and how it ends: a tenth run to the budget, the rest stop at
        a length spread evenly over [min_len, max_new_tokens)."""
        u = zlib.crc32(f"len:{rid}".encode()) / 2**32
        if u >= 0.9:
            return self.max_new_tokens, "length"
        span = self.max_new_tokens - self.min_len
        return self.min_len + int(u / 0.9 * span), "stop"

    def expected(self, rid: str) -> list[int]:
        """The whole response of `rid`."""
        start = self.start(rid)
        n, reason = self.length(rid)
        out = self.tokens[start : start + n]
        if reason == "stop":
            out[-1] = self.eos_id
        return out


class Checker:
    """Every response the trainer is given, against the plan: tokens missing, added or wrong."""

    def __init__(self, plan: TokenPlan, group_size: int) -> None:
        self.plan, self.n = plan, group_size
        self.seen: dict[tuple[int, int], int] = {}  # (step, prompt) -> groups given
        self.responses = self.tokens = self.lost = self.duplicated = self.mismatched = 0
        self.quarantined = 0

    def check(self, group: Group) -> None:
        key = (group.step, group.prompt_index)
        self.seen[key] = self.seen.get(key, 0) + 1
        if group.quarantined:
            self.quarantined += 1
            return
        if self.seen[key] > 1:  # the whole group again
            self.duplicated += sum(len(r.token_ids) for r in group.responses)
            return
        for s in range(max(self.n, len(group.responses))):
            want = self.plan.expected(request_id(group.step, group.prompt_index, s))
            got = group.responses[s].token_ids if s < len(group.responses) else []
            if s >= self.n:
                self.duplicated += len(got)
                continue
            self.responses += 1
            self.tokens += len(got)
            self.lost += max(0, len(want) - len(got))
            self.duplicated += max(0, len(got) - len(want))
            common = min(len(got), len(want))
            if got[:common] != want[:common]:  # other tokens, not only too few or too many
                self.mismatched += 1

    def never_given(self, steps: int, prompts: int) -> int:
        """Tokens of the responses of groups the trainer never got."""
        return sum(
            len(self.plan.expected(request_id(step, p, s)))
            for step in range(steps)
            for p in range(prompts)
            if (step, p) not in self.seen
            for s in range(self.n)
        )


@dataclass
class Held:
    """A request this worker generates, under one lease."""

    lease: int
    grant: str  # its job's: the deltas and the release echo it
    entry_id: bytes
    start: int  # its place in the token pool
    length: int  # its whole response's length
    reason: FinishReason
    offset: int  # tokens of the response before the next one sent


@dataclass
class Counts:
    tokens: int = 0
    flushes: int = 0
    items: int = 0
    jobs: int = 0
    continuations: int = 0  # jobs with a prefix (migrated requests)
    bad_prefix: int = 0  # continuations whose prefix is not the plan's: the coordinator erred
    released: int = 0
    aborted: int = 0
    late_ticks: int = 0  # ticks started more than a tick late (this process fell behind)


class SyntheticWorker:
    def __init__(self, args: argparse.Namespace, plan: TokenPlan) -> None:
        self.args, self.plan = args, plan
        self.r = connect(args.redis_url)
        self.id = args.worker_id
        self.tick_s = args.tokens_per_flush * args.slots / args.tok_s
        self.run_id: str | None = None
        self.version: int | None = None
        self.paused_version: int | None = None
        self.cap: int | None = None
        self.held: dict[str, Held] = {}
        self.to_release: list[tuple[RequestLease, ReleaseReason]] = []
        self.control_last = b"0-0"
        self.jobs: StreamConsumer[Job] | None = None
        self.counts = Counts()
        self.shards = 1  # the run's coordinator shards (its jobs say)
        self.next_look = 0.0

    async def run(self) -> None:
        await self._register()
        last = range_entries(await self.r.xrevrange(keys.worker_control(self.id), count=1))
        self.control_last = last[0][0] if last else b"0-0"  # orders to an earlier incarnation
        beating = asyncio.create_task(self._heartbeat_forever())
        try:
            next_tick = time.monotonic()
            while True:
                if beating.done():
                    beating.result()
                now = time.monotonic()
                if now >= self.next_look:
                    self.next_look = now + LOOK_S
                    await self._look()
                paused = self.paused_version == self.version and not self.to_release
                if self.version is None or paused:
                    await asyncio.sleep(IDLE_S)
                    next_tick = time.monotonic()
                    continue
                await self._read_jobs()
                if self.held or self.to_release:
                    await self._flush()
                next_tick += self.tick_s
                wait = next_tick - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                elif wait < -self.tick_s:  # behind by more than a tick: no burst to catch up
                    self.counts.late_ticks += 1
                    next_tick = time.monotonic()
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)

    async def _register(self) -> None:
        body = {
            "id": self.id,
            "pool": "preemptible",
            "engine": "synthetic",
            "slots": self.args.slots,
            "url": "",
        }
        async with httpx.AsyncClient(timeout=10.0) as http:
            for _ in range(100):
                with contextlib.suppress(httpx.HTTPError):
                    resp = await http.post(f"{self.args.coordinator_url}/v1/workers", json=body)
                    if resp.status_code == 201:
                        return
                    raise RuntimeError(f"registration refused: {resp.status_code} {resp.text}")
                await asyncio.sleep(0.2)
        raise RuntimeError("coordinator not reachable")

    async def _heartbeat_forever(self) -> None:
        key, ttl_ms = keys.worker_heartbeat(self.id), int(self.args.heartbeat_ttl_s * 1000)
        while True:
            beat = Heartbeat(
                worker_id=self.id,
                pool="preemptible",
                run_id=self.run_id,
                version=self.version,
                active=len(self.held),
                slots=self.args.slots,
                tokens_generated=self.counts.tokens,
                at=time.time(),
                paused=self.paused_version is not None and self.paused_version == self.version,
            )
            await with_reconnect(partial(self.r.set, key, beat.encode(), px=ttl_ms), "heartbeat")
            await asyncio.sleep(self.args.heartbeat_s)

    async def _look(self) -> None:
        """The active run, its committed version, the step's read cap and new orders."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.get(keys.ACTIVE_RUN)
            if self.run_id is not None:
                pipe.get(keys.run_version(self.run_id))
                pipe.get(keys.read_cap(self.run_id, self.version or 0))
            pipe.xread({keys.worker_control(self.id): self.control_last}, count=100)
            replies = await with_reconnect(pipe.execute, "look")
        run = replies[0].decode() if replies[0] else None
        if run is None or run != self.run_id:
            if run != self.run_id:
                self._switch(run, None)
            return
        raw_version, raw_cap, orders = replies[1], replies[2], replies[3]
        version = int(raw_version) if raw_version is not None else None
        if version != self.version:
            self._switch(run, version)
            return
        self.cap = int(raw_cap) if raw_cap is not None else None
        for entry in read_entries(orders):
            self.control_last = entry[0]
            order = decode_or_park(WorkerControl, entry, [])
            if order is not None and order.run_id == self.run_id:
                self._obey(order)

    def _switch(self, run_id: str | None, version: int | None) -> None:
        """A new run or version: what is held is no longer ours to finish."""
        self.run_id, self.version, self.cap = run_id, version, None
        self.held.clear()
        self.to_release.clear()
        self.jobs = None
        if run_id is not None and version is not None:
            stream = keys.jobs_stream(run_id, version)
            self.jobs = StreamConsumer(
                self.r, stream, keys.WORKERS_GROUP, self.id, Job, replay=False
            )

    def _obey(self, order: WorkerControl) -> None:
        if order.action == "abort":
            for req in order.requests:
                held = self.held.get(req.request_id)
                if held is not None and held.lease == req.lease:
                    del self.held[req.request_id]  # its entry is no longer ours to ack
                    self.counts.aborted += 1
        elif order.action == "release":
            self._release(order.count, "balance")
        elif order.action == "pause" and order.version == self.version:
            self.paused_version = order.version
            self._release(len(self.held), "seed")
        elif order.action == "resume" and order.version == self.paused_version:
            self.paused_version = None

    def _release(self, count: int, reason: ReleaseReason) -> None:
        """Give back the `count` requests with the most tokens left, in the next flush."""
        order = sorted(self.held.items(), key=lambda kv: kv[1].length - kv[1].offset)
        for rid, held in order[::-1][:count]:
            self.to_release.append(
                (RequestLease(request_id=rid, lease=held.lease, grant=held.grant), reason)
            )

    async def _read_jobs(self) -> None:
        if self.jobs is None:
            return
        free = self.args.slots - len(self.held)
        # the step's cap comes with its jobs: one at a time till then
        free = min(free, 1) if self.cap is None else min(free, self.cap - len(self.held))
        if free <= 0:
            return
        read = await self.jobs.read(free, None if self.held else READ_BLOCK_MS)
        for entry_id, job in read.messages:
            start = self.plan.start(job.request_id)
            length, reason = self.plan.length(job.request_id)
            offset = len(job.prefix_ids)
            if offset:
                self.counts.continuations += 1
                plan = self.plan.tokens[start : start + offset]
                if job.prefix_ids != plan:
                    self.counts.bad_prefix += 1
            self.held[job.request_id] = Held(
                job.lease, job.grant, entry_id, start, length, reason, offset
            )
            self.shards = job.shards
            self.counts.jobs += 1
        if read.parked:
            await self.r.xack(self.jobs.stream, keys.WORKERS_GROUP, *[p[0] for p in read.parked])

    async def _flush(self) -> None:
        """One tick: `tokens_per_flush` new tokens of every request held, then the releases."""
        assert self.run_id is not None and self.version is not None
        plan, per = self.plan, self.args.tokens_per_flush
        items, done = [], []
        for rid, h in self.held.items():
            n = min(per, h.length - h.offset)
            at = h.start + h.offset
            tokens = plan.tokens[at : at + n]
            finished = h.offset + n >= h.length
            if finished and h.reason == "stop":
                tokens[-1] = plan.eos_id
            items.append(
                DeltaItem(
                    request_id=rid,
                    lease=h.lease,
                    grant=h.grant,
                    offset=h.offset,
                    token_ids=tokens,
                    logprobs=plan.logprobs[at : at + n],
                    finished=finished,
                    finish_reason=h.reason if finished else None,
                )
            )
            if finished:
                done.append(rid)
        releases = [
            lease
            for lease, _ in self.to_release
            if lease.request_id in self.held and lease.request_id not in done
        ]
        reason: ReleaseReason = self.to_release[0][1] if self.to_release else "preemption"
        self.to_release.clear()
        batch = DeltaBatch(
            worker_id=self.id,
            version=self.version,
            items=items,
            released=releases,
            release_reason=reason,
        )
        gone = done + [lease.request_id for lease in releases]
        acks = [self.held[rid].entry_id for rid in gone]
        run_id, jobs = self.run_id, keys.jobs_stream(self.run_id, self.version)
        by_shard = split_by_shard(batch, self.shards)

        async def send() -> None:
            async with self.r.pipeline(transaction=False) as pipe:
                for shard, part in by_shard.items():
                    pipe.xadd(keys.deltas_stream(run_id, shard), part.fields(), nomkstream=True)
                if acks:
                    pipe.xack(jobs, keys.WORKERS_GROUP, *acks)
                await pipe.execute()

        await with_reconnect(send, "flush")
        for item in items:
            self.held[item.request_id].offset += len(item.token_ids)
            self.counts.tokens += len(item.token_ids)
        for rid in gone:
            del self.held[rid]
        self.counts.flushes += 1
        self.counts.items += len(items)
        self.counts.released += len(releases)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--coordinator-url", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--stats", type=Path, required=True, help="counts written here on SIGTERM")
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--tok-s", type=float, default=250_000.0, help="with every slot busy")
    p.add_argument("--tokens-per-flush", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--eos-id", type=int, default=1)
    p.add_argument("--token-ids", default="3,4,5,6,7,8,9,10,11,12")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument("--heartbeat-ttl-s", type=float, default=3.0)
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> TokenPlan:
    token_ids = [int(t) for t in args.token_ids.split(",")]
    return TokenPlan(args.max_new_tokens, args.min_len, args.eos_id, token_ids, args.seed)


async def amain(args: argparse.Namespace) -> None:
    worker = SyntheticWorker(args, plan_of(args))
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        await worker.run()
    except asyncio.CancelledError:
        pass
    finally:
        args.stats.write_text(json.dumps(vars(worker.counts)))
        await worker.r.aclose()


def profiled_coordinator(out: Path) -> None:
    """Run the coordinator service here under cProfile; SIGUSR1 writes the profile to `out`
    (uvicorn answers SIGTERM with its own shutdown: the bench asks for the profile first)."""
    import cProfile
    import runpy

    profile = cProfile.Profile(time.thread_time)  # CPU time: on a shared machine, not waits

    def dump(signum: int, frame: object) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, dump)
    profile.enable()
    runpy.run_module("services.coordinator.main", run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profiled-coordinator"]:  # bench/coordinator.py --profile
        profiled_coordinator(Path(argv[1]))
        return
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(amain(args))
    else:
        uvloop.run(amain(args))


if __name__ == "__main__":
    main()
