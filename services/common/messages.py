"""The messages that cross service boundaries, encoded as msgpack (never pickle).

Each type is a pydantic model, so a message is validated when decoded: a malformed one raises
`MalformedMessage` with the reason, and the reader parks it instead of crashing. On a stream, a
message is one entry with the single field `m` holding the msgpack bytes.
"""

from typing import Literal, Self

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

FinishReason = Literal["stop", "length", "abort"]
Pool = Literal["reserved", "preemptible"]
# crash: the worker's engine died of an error while running the request (counted toward poison)
ReleaseReason = Literal["preemption", "seed", "balance", "crash"]
FIELD = b"m"


class MalformedMessage(ValueError):
    """A message that could not be decoded or does not match its type."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        try:
            return cls.model_validate(msgpack.unpackb(data, raw=False))
        except (ValueError, TypeError, msgpack.UnpackException, ValidationError) as exc:
            raise MalformedMessage(f"{cls.__name__}: {exc}") from exc

    def fields(self) -> dict[bytes, bytes]:
        """The stream entry for XADD."""
        return {FIELD: self.encode()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> Self:
        if FIELD not in fields:
            raise MalformedMessage(f"{cls.__name__}: entry has no field 'm'")
        return cls.decode(fields[FIELD])


class Job(Message):
    """A token-level job: continue `prompt_ids + prefix_ids` for at most `remaining_tokens`."""

    run_id: str
    request_id: str  # "{step}:{prompt_index}:{sample_index}"
    lease: int = Field(ge=0)  # bumped on every migration; deltas with an older lease are dropped
    version: int = Field(ge=0)  # weight version that must generate every token
    prompt_ids: list[int]
    prefix_ids: list[int] = []  # tokens already collected for this request (a continuation)
    remaining_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)  # 0 = greedy
    top_p: float = Field(gt=0.0, le=1.0)
    seed: int  # per-request sampling seed
    stop_token_ids: list[int] = []
    # run with nothing beside it: the request was running when a worker crashed, so a crash it
    # causes again is its own (poison requests are told from bystanders this way)
    isolate: bool = False


class DeltaItem(Message):
    """New tokens of one request since the worker's last flush."""

    request_id: str
    lease: int
    offset: int = Field(ge=0)  # index in the response of token_ids[0]
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution
    finished: bool = False
    finish_reason: FinishReason | None = None


class RequestLease(Message):
    """One request under one lease: what a worker releases, or is told to drop."""

    request_id: str
    lease: int


class DeltaBatch(Message):
    """One flush of a worker: deltas of all its active requests, then the requests it releases.

    Releases travel in the same stream as the deltas, after them, so the coordinator has every
    flushed token of a released request before it migrates it.
    """

    worker_id: str
    version: int
    items: list[DeltaItem]
    released: list[RequestLease] = []  # given back unfinished
    release_reason: ReleaseReason = "preemption"  # why `released` were given back


class WorkerControl(Message):
    """An order to one worker, on its control stream.

    abort: drop `requests` (their lease moved on: fencing). release: give back `count` executing
    requests (load balancing). pause: give back everything and read no job of `version` (a
    reserved worker stepping aside after its seeding window; a newer version resumes it).
    """

    action: Literal["abort", "release", "pause"]
    run_id: str
    requests: list[RequestLease] = []
    count: int = 0
    version: int | None = None


class Response(Message):
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    finish_reason: FinishReason
    leases: int = 1  # how many leases (1 + migrations) produced it


class Group(Message):
    """All n responses to one prompt, ready for the trainer; or, with `quarantined`, a group
    dropped from the step (a request of it crashed too many workers): no responses, counted
    toward the step's B and never trained on."""

    run_id: str
    step: int
    version: int
    prompt_index: int
    prompt_ids: list[int]
    responses: list[Response]
    quarantined: bool = False


class Heartbeat(Message):
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
