"""The typed records of spotrl's Redis hashes: a run, the trainer's state of a run, a worker's
registration, a step's start, each one `msgspec.Struct`, and the pure conversion both ways.

A record's hash keeps each field as text: a string as itself, a number as its decimal text (what
HSET and HINCRBY write), and the fields named in a record's `JSON_FIELDS` as JSON. `from_hash`
reads a hash as HGETALL or HMGET answers it and is tolerant: a field the record does not know
(another version of a service wrote it) is ignored, and so is a value of the wrong type, with a
warning. `to_fields` is strict: a name that is not a field of the record is a TypeError, a value
of the wrong type a ValueError, so a typo cannot write a field nobody reads.

It does not talk to Redis: `services.state` reads and writes the hashes with these records
(`run_record`, `trainer_state`, `worker_record`); the key names are in `keys`.
"""

import json
import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import msgspec

from services.contracts.messages import Pool
from services.contracts.runspec import RunSpec, RunState

log = logging.getLogger(__name__)


class HashRecord(msgspec.Struct, kw_only=True):
    """The conversion shared by the records: see the module's docstring."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset()  # fields kept as JSON text
    UNBOUNDED: ClassVar[frozenset[str]] = frozenset()  # JSON fields whose null is infinity

    @classmethod
    def check_names(cls, *names: str) -> tuple[str, ...]:
        """`names`, each a field of the record (else TypeError)."""
        unknown = [n for n in names if n not in cls.__struct_fields__]
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
        return names

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str | None], key: str = "") -> Self:
        """The record of a hash as HGETALL answers it (or HMGET's names and values: a None
        value is a field not written); `key` names the hash in the warnings."""
        good: dict[str, Any] = {}
        for raw_name, raw_value in raw.items():
            name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else raw_name
            if name not in cls.__struct_fields__ or raw_value is None:
                continue
            value = raw_value.decode() if isinstance(raw_value, bytes) else raw_value
            try:
                good[name] = cls._decoded(name, value)
                msgspec.convert({name: good[name]}, cls, strict=False)
            except (ValueError, msgspec.ValidationError) as exc:
                good.pop(name, None)
                log.warning("%s %s: ignoring field %s: %s", cls.__name__, key, name, exc)
        return msgspec.convert(good, cls, strict=False)

    @classmethod
    def _decoded(cls, name: str, value: str) -> Any:
        if name not in cls.JSON_FIELDS:
            return value
        decoded = json.loads(value)
        return math.inf if decoded is None and name in cls.UNBOUNDED else decoded

    @classmethod
    def to_fields(cls, **changes: Any) -> dict[str, str]:
        """The hash fields (name -> text) that write `changes`, checked against the record:
        an unknown name is a TypeError, a value of the wrong type a ValueError."""
        cls.check_names(*changes)
        try:
            msgspec.convert(changes, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{cls.__name__}: {exc}") from None
        return {name: cls._encoded(name, value) for name, value in changes.items()}

    @classmethod
    def _encoded(cls, name: str, value: Any) -> str:
        if name in cls.JSON_FIELDS:
            if name in cls.UNBOUNDED and value is not None and math.isinf(value):
                value = None
            return json.dumps(value)
        if value is None:
            raise ValueError(f"{cls.__name__}.{name}: None is not written (drop the field)")
        return str(value)

    def fields(self) -> dict[str, str]:
        """The hash fields of every field of the record that is set (not None)."""
        names = self.__struct_fields__
        return self.to_fields(**{n: v for n in names if (v := getattr(self, n)) is not None})


class RunRecord(HashRecord, kw_only=True):
    """A run (`keys.run`): written by the coordinator (submit, activation, stalls, seeding, the
    end) and by the trainer (it fails a run whose weights were taken over)."""

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"n_prem_recommended", "preemptible_wanted"})
    UNBOUNDED: ClassVar[frozenset[str]] = frozenset({"n_prem_recommended"})

    id: str = ""  # the run id (also the hash's key)
    # the RunSpec as JSON text, sectioned (`run_spec()` parses it; a spec stored flat, before
    # sections, parses too)
    spec: str = ""
    state: RunState | None = None  # None: the hash has no state (never written whole)
    created_at: float | None = None  # submitted, unix s
    started_at: float | None = None  # made active (running), unix s
    finished_at: float | None = None  # reached a final state, unix s
    error: str = ""  # why it failed (a final state's reason), "" for none
    stall_reason: str = ""  # why it cannot progress, while stalled ("" otherwise)
    stalled_since: float | None = None  # when it last became stalled, unix s (while stalled)
    t_seed_s: float | None = None  # seeding window of the next step, s (None: no step trained)
    n_prem_recommended: float | None = None  # preemptible pool size past which a step gets no
    # shorter (math.inf: no limit, null in Redis; None: no step trained yet)
    preemptible_wanted: int | None = None  # preemptible workers a scaler should hold (None:
    # no step trained yet, or no wish: hold what you can get); JSON in Redis
    groups_quarantined: int = 0  # groups dropped: a request crashed too many workers (HINCRBY)
    # paused by an operator since then, unix s (None: not paused): no new step opens, the steps
    # in flight finish, and the run's part of the fleet goes to the other runs
    paused_at: float | None = None
    # who submitted it: the first 16 hex digits of the SHA-256 of the bearer token it came
    # with ("" where the coordinator takes writes without a token); the per-token limits
    owner: str = ""

    def run_spec(self) -> RunSpec:
        """The spec, parsed (pydantic's ValidationError for a spec that is not one)."""
        return RunSpec.model_validate_json(self.spec)


class TrainerState(HashRecord, kw_only=True):
    """The trainer's counters of a run (`keys.trainer_state`), written by the trainer only."""

    steps_trained: int = 0  # steps whose version the trainer committed (= the next step)
    groups_trained: int = 0  # groups trained on, all steps (HINCRBY)
    groups_incomplete: int = 0  # groups that came with another number of responses (HINCRBY)


class WorkerRecord(HashRecord, kw_only=True):
    """A rollout worker's registration (`keys.worker`): written by the coordinator's register
    route; `gone_since` by the coordinator while the worker has no heartbeat. Liveness is the
    heartbeat key, not this record."""

    id: str = ""  # the worker id (also the hash's key)
    pool: Pool | None = None  # None: no registration (the hash holds only `gone_since`)
    engine: str = ""  # the inference engine it runs ("vllm", "hf", ...)
    slots: int = 0  # requests it decodes at once
    url: str = ""  # where its peers fetch weight blocks from it ("" for none)
    registered_at: float | None = None  # its latest registration, unix s
    gone_since: float | None = None  # first seen without a heartbeat, unix s (None: alive)


class StepMeta(HashRecord, kw_only=True):
    """A step's start on one coordinator shard (`keys.step_meta`), written as it queues the
    shard's jobs of the step."""

    queued: int = 0  # 1 once the shard's jobs of the step are on their stream
    started_at: float | None = None  # when the step started, unix s
    # the Redis primary (host:port, as Sentinel names it) the step's state was written on:
    # with its first jobs, and again once every unfinished request moved on after a failover;
    # "" with a plain Redis URL
    primary: str = ""
