"""The messages that cross service boundaries, encoded as msgpack (never pickle).

Each type is a msgspec `Struct`, decoded straight from msgpack into the typed object and
validated on the way (in C: the deltas carry every token a run makes, so this is the hot path).
A malformed message raises `MalformedMessage` with the reason, and the reader parks it instead of
crashing. Construction does not validate: a message is checked where it crosses a boundary, when
decoded (but for a bound msgspec.Meta cannot say: a `__post_init__`, which both run). On a
stream, a message is one entry with the single field `m` holding the msgpack bytes.

Messages name the step they belong to `step`; a `version` is always a weight version (the one
that generated a batch's tokens, the one a worker holds), which under `max_staleness` can be older
than the step. A field renamed since an earlier release is read under its old name too
(`RENAMED`), and one removed is dropped (`REMOVED`): an entry that release left in a stream at
upgrade is still read correctly.
"""

from typing import Annotated, Any, Literal, Self

import msgspec

from services.contracts.sampling import SamplingParams
from services.contracts.shards import MAX_COORDINATOR_SHARDS

FinishReason = Literal["stop", "length", "abort"]
Pool = Literal["reserved", "preemptible"]
# crash: the worker's engine died of an error while running the request (counted toward poison)
ReleaseReason = Literal["preemption", "seed", "balance", "crash", "swap", "death"]
FIELD = b"m"
# An entry's fields as redis-py's XADD types them (its FieldT and EncodableT), spelled out here so
# that the contracts do not import redis.
Encodable = bytes | bytearray | memoryview | str | int | float
StreamFields = dict[Encodable, Encodable]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
# a job's draft references (`Job.drafts`): how many, and how many tokens in all
MAX_DRAFT_REFERENCES = 16
MAX_DRAFT_TOKENS = 32768


class MalformedMessage(ValueError):
    """A message that could not be decoded or does not match its type."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}  # one per type, built on its first use


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
        try:
            return decoder.decode(data)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            upgraded = _upgraded(cls, data)  # only a message that does not decode pays for it
            if upgraded is None:
                raise MalformedMessage(f"{cls.__name__}: {exc}") from exc
            try:
                return decoder.decode(upgraded)
            except (msgspec.DecodeError, ValueError, TypeError):
                raise MalformedMessage(f"{cls.__name__}: {exc}") from exc

    def fields(self) -> StreamFields:
        """The stream entry for XADD."""
        return {FIELD: self.encode()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> Self:
        if FIELD not in fields:
            raise MalformedMessage(f"{cls.__name__}: entry has no field 'm'")
        return cls.decode(fields[FIELD])

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (messages are frozen)."""
        return msgspec.structs.replace(self, **changes)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise MalformedMessage(f"{cls.__name__}: {exc}") from exc


class Job(Message, frozen=True, kw_only=True):
    """A token-level job: continue `prompt_ids + prefix_ids` for at most `remaining_tokens`."""

    run_id: str
    request_id: str  # "{step}:{prompt_index}:{sample_index}"
    lease: NonNegative  # bumped on every migration; deltas with an older lease are dropped
    # the lease's secret (hex, new for every lease, made by the coordinator's request table):
    # only the worker that read this job knows it, and its deltas and release echo it; one
    # that does not is refused (a worker cannot write tokens into a request it does not hold)
    grant: str
    # the step the request belongs to (`request_id`'s first part; "version" before issue 49):
    # under `max_staleness` a worker that holds an older weight version may serve it
    step: NonNegative
    prompt_ids: list[int]
    prefix_ids: list[int] = []  # tokens already collected for this request (a continuation)
    remaining_tokens: Annotated[int, msgspec.Meta(ge=1)]
    # the run's (spec.sampling): temperature, top-p, top-k, repetition penalty; its
    # max_new_tokens is the whole response's budget, remaining_tokens what this job may add
    sampling: SamplingParams
    seed: int  # per-request sampling seed
    stop_token_ids: list[int] = []
    # run with nothing beside it: the request was running when a worker crashed, so a crash it
    # causes again is its own (poison requests are told from bystanders this way)
    isolate: bool = False
    # the run's coordinator shards: the worker sends the request's deltas to the stream of its
    # shard (`contracts.shards.shard_of`)
    shards: Annotated[int, msgspec.Meta(ge=1, le=MAX_COORDINATOR_SHARDS)] = 1
    # token sequences the request is likely to repeat (its group's finished siblings, earlier
    # responses to the same prompt), oldest first: the engine drafts from them and verifies
    # each draft against its own seeded draws, so they change how fast, never which tokens.
    # At most MAX_DRAFT_REFERENCES of them, MAX_DRAFT_TOKENS tokens in all; [] : none
    drafts: Annotated[list[list[int]], msgspec.Meta(max_length=MAX_DRAFT_REFERENCES)] = []

    def __post_init__(self) -> None:
        """The one bound msgspec.Meta cannot say: the drafts' tokens in all (checked when
        decoded, as every bound here, and on construction too)."""
        total = sum(len(d) for d in self.drafts)
        if total > MAX_DRAFT_TOKENS:
            raise ValueError(f"drafts hold {total} tokens, more than {MAX_DRAFT_TOKENS}")


class DeltaItem(Message, frozen=True, kw_only=True):
    """New tokens of one request since the worker's last flush."""

    request_id: str
    lease: int
    grant: str  # the job's (`Job.grant`): proves the worker holds the lease
    offset: NonNegative  # index in the response of token_ids[0]
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution
    finished: bool = False
    finish_reason: FinishReason | None = None
    # speculative decoding behind these tokens: forward passes that verified a draft, the
    # draft tokens they verified, and how many of those were kept (the engine's own draws)
    draft_forwards: NonNegative = 0
    drafted: NonNegative = 0
    accepted: NonNegative = 0


class RequestLease(Message, frozen=True, kw_only=True):
    """One request under one lease: what a worker releases, or is told to drop."""

    request_id: str
    lease: int
    # the job's (`Job.grant`) in a release, which is refused without it; "" in an order to a
    # worker (the coordinator names a lease there, it proves nothing)
    grant: str = ""


class DeltaBatch(Message, frozen=True, kw_only=True):
    """One flush of a worker: deltas of all its active requests, then the requests it releases.

    Releases travel in the same stream as the deltas, after them, so the coordinator has every
    flushed token of a released request before it migrates it.
    """

    worker_id: str
    version: int  # the weight version that generated these tokens (not always the step's)
    items: list[DeltaItem]
    released: list[RequestLease] = []  # given back unfinished
    release_reason: ReleaseReason = "preemption"  # why `released` were given back


class WorkerControl(Message, frozen=True, kw_only=True):
    """An order to one worker, on its control stream.

    abort: drop `requests` (their lease moved on: fencing). release: give back `count` executing
    requests (load balancing). pause: give back everything and read no job of `version` (a
    reserved worker stepping aside after its seeding window; a newer version resumes it).
    resume: read jobs of `version` again (the reserved pool recalled: no preemptible worker is
    left to finish the step). serve: serve run `run_id` from now on (the fleet's placement,
    when several runs are active: the worker gives back what it holds of another run first).
    """

    action: Literal["abort", "release", "pause", "resume", "serve"]
    run_id: str
    requests: list[RequestLease] = []
    count: int = 0
    version: int | None = None  # a weight version (the one the paused workers hold)


class Response(Message, frozen=True, kw_only=True):
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: FinishReason
    leases: int = 1  # how many leases (1 + migrations) produced it
    # the weight version of each token, as (offset, version) runs: the version generated the
    # tokens from its offset to the next run's; [] from a coordinator that did not record them
    version_runs: list[tuple[NonNegative, NonNegative]] = []
    # the tokens the model did not generate (a multi-turn episode's observations: tool results,
    # feedback), as (offset, length) spans, in order and not overlapping (contracts.spans); their
    # logprobs are placeholders (0.0), never used. [] when the model generated every token
    observed: list[tuple[NonNegative, Positive]] = []


class Group(Message, frozen=True, kw_only=True):
    """All n responses to one prompt, ready for the trainer; or, with `quarantined`, a group
    dropped from the step (a request of it crashed too many workers): no responses, counted
    toward the step's B and never trained on."""

    run_id: str
    # the step, and the weight version it trains against: the trainer counts a token that an
    # older version generated (its response's version_runs) as stale
    step: int
    prompt_index: int
    prompt_ids: list[int]
    responses: list[Response]
    quarantined: bool = False


class FleetAllotment(Message, frozen=True, kw_only=True):
    """The fleet's slots and each active run's part of them (`core.fleet_shares.allot`), as
    the placer last allotted them (keys.FLEET_ALLOT)."""

    slots: NonNegative
    runs: dict[str, NonNegative]
    shares: dict[str, float] = {}  # each run's weight (RolloutSection.share; absent: 1)


class RunLoad(Message, frozen=True, kw_only=True):
    """What a worker that serves several runs at once holds of one of them."""

    version: int | None  # the run's weight version loaded, None before its first load
    active: int  # the run's requests held
    paused: bool = False  # stepped aside from this run for the rest of its version


class Heartbeat(Message, frozen=True, kw_only=True):
    worker_id: str
    pool: Pool
    run_id: str | None
    version: int | None  # weight version loaded, None before the first load
    active: int  # requests executing
    slots: int
    tokens_generated: int
    at: float  # unix time
    plateau: int = 0  # measured plateau batch size (0: not known)
    paused: bool = False  # stepped aside for the rest of this version
    error: str = ""  # the error a task of the worker died of: it is shutting down, serves nothing
    # a worker serving several runs at once on one engine (LoRA runs on one base, issue 52):
    # each run's own load, `run_id` the first of them and `active` their sum; empty: it serves
    # `run_id` alone, as `version`, `active` and `paused` say
    runs: dict[str, RunLoad] = {}

    @property
    def served_runs(self) -> list[str]:
        """The runs it serves now (none before its first run)."""
        if self.runs:
            return list(self.runs)
        return [self.run_id] if self.run_id is not None else []

    def serving(self, run_id: str) -> "Heartbeat | None":
        """The beat as one run's step loop reads it: `run_id`'s version, requests held and
        pause, as if the worker served that run alone; None where it does not serve it."""
        if not self.runs:
            return self if self.run_id == run_id else None
        load = self.runs.get(run_id)
        if load is None:
            return None
        return msgspec.structs.replace(
            self, run_id=run_id, version=load.version, active=load.active, paused=load.paused,
            runs={},
        )  # fmt: skip


# Fields renamed since an earlier release, by type: old name -> new name. An entry of that
# release (a job queued before an upgrade) is read under the new names.
RENAMED: dict[type[Message], dict[str, str]] = {Job: {"version": "step"}}
# Fields removed since an earlier release, by type: their values are derived now (a group's
# "version" was always its step).
REMOVED: dict[type[Message], set[str]] = {Group: {"version"}}


def _upgraded(cls: type[Message], data: bytes) -> bytes | None:
    """`data`, an entry of an earlier release, with its renamed fields under their new names and
    its removed ones dropped; None when it has none of them (then it is malformed, not old)."""
    renamed, removed = RENAMED.get(cls, {}), REMOVED.get(cls, set())
    if not renamed and not removed:
        return None
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict):
        return None
    moved = {old: new for old, new in renamed.items() if old in raw and new not in raw}
    gone = removed & raw.keys()
    if not moved and not gone:
        return None
    return _ENCODER.encode({moved.get(k, k): v for k, v in raw.items() if k not in gone})
