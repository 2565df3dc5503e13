"""How a rollout worker makes itself known: it registers with the coordinator once (retrying
while the coordinator is unreachable) and then heartbeats into Redis, a key with a TTL that
says what it serves, how busy it is and whether it stepped aside or crashed.

It does not decide anything from what others say: it only reports.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial

import httpx

from services.contracts import keys
from services.contracts.messages import Heartbeat, RunLoad
from services.infra.redis_streams import with_reconnect
from services.infra.retry import retry
from services.infra.service import auth_headers
from services.infra.signing import registration_proof
from services.infra.tls import client_verify
from services.rollout.context import WorkerShared
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
REGISTER_TIMEOUT_S = 10.0
# the coordinator says "later": over a rate, its Redis away, or this id still alive (409)
NOT_NOW = (409, 429, 503)


class CoordinatorNotNow(Exception):
    """The coordinator answered "not now" (`NOT_NOW`): registering is tried again."""


@dataclass(frozen=True)
class Registration:
    """What the coordinator answered: where it gives each worker its own Redis user
    (`worker_redis_users`), that user's credentials and the key this worker signs its delta
    batches with (hex); otherwise none of them, and the worker goes on as configured."""

    redis_username: str | None = None
    redis_password: str | None = None
    signing_key: str | None = None
    consumer: str | None = None  # the name it reads its jobs as (None: its id)

    @classmethod
    def of(cls, answer: object) -> "Registration":
        """From the coordinator's JSON answer (a field missing: not given)."""
        if not isinstance(answer, dict):
            return cls()
        fields = ("redis_username", "redis_password", "signing_key", "consumer")
        got = {name: answer.get(name) for name in fields}
        return cls(**{name: v for name, v in got.items() if isinstance(v, str) and v})


async def register(s: RolloutSettings, key: bytes | None = None) -> Registration:
    """Register with the coordinator, again while it is unreachable or says "not now" (or,
    where it mints workers' users, that this id is still alive: an earlier process under it has
    not timed out yet); a refusal is a RuntimeError (not retried). With `key` (the signing key
    of this process's registration before), it proves that it is the one registering again.
    Returns what the coordinator answered."""
    body = {
        "id": s.worker_id,
        "pool": s.pool,
        "engine": s.engine,
        "slots": s.slots,
        "url": s.advertise_url,
    }
    if key is not None:
        body["proof"] = registration_proof(key, s.worker_id)

    async def post() -> Registration:
        async with httpx.AsyncClient(timeout=REGISTER_TIMEOUT_S, verify=client_verify(s)) as http:
            resp = await http.post(
                f"{s.coordinator_url}/v1/workers",
                json=body,
                headers=auth_headers(s.outgoing_token()),
            )
        if resp.status_code in NOT_NOW:
            raise CoordinatorNotNow(f"{resp.status_code} {resp.text}")
        if resp.status_code != 201:
            raise RuntimeError(f"registration refused: {resp.status_code} {resp.text}")
        try:
            return Registration.of(resp.json())
        except ValueError:  # not JSON: nothing minted
            return Registration()

    answer = await retry(
        post,
        "register (coordinator not reachable)",
        on=(httpx.HTTPError, CoordinatorNotNow),
        first_delay_s=0.2,
    )
    own_user = f", Redis user {answer.redis_username}" if answer.redis_username else ""
    log.info("registered %s (%s pool%s)", s.worker_id, s.pool, own_user)
    return answer


def heartbeat(w: WorkerShared) -> Heartbeat:
    """What the worker says about itself now: the run it serves, or each of the runs it serves
    at once (`Heartbeat.runs`)."""
    lanes = list(w.lanes.values())
    first = lanes[0] if lanes else None
    runs = {
        ctx.run_id: RunLoad(version=ctx.version, active=ctx.busy, paused=ctx.paused)
        for ctx in lanes
    }
    return Heartbeat(
        worker_id=w.s.worker_id,
        pool=w.s.pool,
        run_id=first.run_id if first else None,
        version=first.version if first else None,
        active=w.busy,
        slots=w.s.slots,
        tokens_generated=w.tokens_generated,
        plateau=w.plateau.plateau(),
        paused=bool(lanes) and all(ctx.paused for ctx in lanes),
        error=w.crashed,
        at=time.time(),
        runs=runs if len(runs) > 1 else {},
    )


async def heartbeat_forever(w: WorkerShared) -> None:
    key = keys.worker_heartbeat(w.s.worker_id)
    ttl_ms = int(w.s.heartbeat_ttl_s * 1000)
    while True:
        beat = heartbeat(w).encode()
        await with_reconnect(partial(w.r.set, key, beat, px=ttl_ms), "heartbeat")
        await asyncio.sleep(w.s.heartbeat_s)
