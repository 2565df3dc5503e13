"""How a run's end is told and tidied, shared by the scheduler (shard 0) and the other shards:
the error text users read, the final state a run reached under its manager, and dropping what a
manager wrote after its run ended."""

from services.contracts import keys
from services.contracts.runspec import FINAL_STATES
from services.coordinator.run.runs import RunStore, release_run
from services.infra.http_limits import clip
from services.state import run_record

MAX_ERROR_CHARS = 1000


def failure_text(exc: Exception) -> str:
    """A failed run's error as users read it: the exception's type and message, cut short;
    never its repr (the repr of a decoding error holds the bytes it could not decode)."""
    return clip(f"{type(exc).__name__}: {exc}", MAX_ERROR_CHARS)


async def ended_as(store: RunStore, run_id: str) -> str | None:
    """The final state of a run (cancelled under its manager, say), or None while it is live."""
    state = await run_record.read_state(store.r, run_id)
    return state if state in FINAL_STATES else None


async def settle(store: RunStore, run_id: str, state: str) -> None:
    """The manager of a run that ended under it has stopped: drop what it wrote meanwhile."""
    await release_run(store.r, run_id, state, store.audit_ttl_s)
    if await store.active() == run_id:
        await store.r.delete(keys.ACTIVE_RUN)
