"""Bookkeeping of the requests of one step: which tokens each response has, under which lease,
and which groups are complete. Pure: no Redis, no clock.

Rules it enforces:
- a delta is applied only for the request's current lease (fencing); older leases are dropped;
- every token keeps the weight version that generated it (its delta batch's), as runs;
- tokens are appended once: a delta's offset must continue the response; a delta that repeats
  tokens already held is trimmed to its new part; one that leaves a gap is refused;
- a response is finished once, and then never changes;
- migrating bumps the lease and continues from the collected tokens, or, with migration off,
  discards them and starts over (the baseline that token-level collection improves on);
- a request that was running when a worker crashed is a suspect: its jobs run isolated (alone on
  a worker) from then on; a group that was quarantined (dropped from the step) is complete and
  none of its requests moves again.
"""

import zlib
from dataclasses import dataclass, field
from enum import Enum

from services.common.messages import DeltaItem, FinishReason, Group, Job, Response


class Applied(Enum):
    APPENDED = "appended"
    FINISHED = "finished"  # appended and the response is now complete
    DUPLICATE = "duplicate"  # nothing new
    STALE_LEASE = "stale_lease"
    GAP = "gap"
    UNKNOWN = "unknown"
    ALREADY_DONE = "already_done"


@dataclass
class RequestState:
    request_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    lease: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (offset, version): the weight version that generated the tokens from `offset` on
    version_runs: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    crashed_on: list[str] = field(default_factory=list)  # workers that crashed running it
    reward: float | None = None  # once finished and scored

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)


def request_id(step: int, prompt_index: int, sample_index: int) -> str:
    return f"{step}:{prompt_index}:{sample_index}"


class RequestTable:
    def __init__(
        self,
        run_id: str,
        step: int,
        version: int,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop_token_ids: list[int],
        top_k: int = 0,
        repetition_penalty: float = 1.0,
    ) -> None:
        self.run_id, self.step, self.version = run_id, step, version
        self.group_size = group_size
        self.temperature, self.top_p = temperature, top_p
        self.top_k, self.repetition_penalty = top_k, repetition_penalty
        self.stop_token_ids = stop_token_ids
        self.requests: dict[str, RequestState] = {}
        self.prompts = prompts
        for p, prompt_ids in enumerate(prompts):
            for s in range(group_size):
                rid = request_id(step, p, s)
                self.requests[rid] = RequestState(
                    rid,
                    p,
                    s,
                    prompt_ids,
                    max_new_tokens,
                    seed=zlib.crc32(f"{seed}:{step}:{p}:{s}".encode()),
                )
        self.pending_groups = set(range(len(prompts)))
        self.unfinished_count = len(self.requests)  # len(unfinished()), kept up to date
        self.quarantined: set[int] = set()  # groups dropped from the step (poison requests)
        self.stats = {a.value: 0 for a in Applied}
        self.tokens_appended = 0  # tokens that are now part of a response
        self.tokens_received = 0  # every token delivered in a delta, stale or repeated included
        self.tokens_discarded = 0  # collected tokens thrown away by restarts (migration off)
        self.migrations: dict[str, int] = {}  # by cause

    def job(self, rid: str) -> Job:
        """The job that continues request `rid` from what has been collected, under its lease."""
        r = self.requests[rid]
        return Job(
            run_id=self.run_id,
            request_id=rid,
            lease=r.lease,
            version=self.version,
            prompt_ids=r.prompt_ids,
            prefix_ids=list(r.token_ids),
            remaining_tokens=max(1, r.remaining),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            seed=r.seed,
            stop_token_ids=self.stop_token_ids,
            isolate=bool(r.crashed_on),
        )

    def initial_jobs(self) -> list[Job]:
        return [self.job(rid) for rid in self.requests]

    def migrate(
        self, rid: str, cause: str, keep_tokens: bool = True, lease: int | None = None
    ) -> Job | None:
        """Bump the lease of an unfinished request and return the job that continues it.

        With `lease` given, only a request still under that lease moves (a release or a reclaim
        that comes after another migration is a no-op). With `keep_tokens` False the collected
        tokens are discarded and the request starts over.
        """
        r = self.requests.get(rid)
        if r is None or r.done or (lease is not None and lease != r.lease):
            return None
        if r.prompt_index in self.quarantined:
            return None
        r.lease += 1
        if not keep_tokens:
            self.tokens_discarded += len(r.token_ids)
            r.token_ids, r.logprobs, r.version_runs = [], [], []
        self.migrations[cause] = self.migrations.get(cause, 0) + 1
        return self.job(rid)

    def note_crash(self, rid: str, lease: int, worker_id: str) -> bool:
        """`worker_id` crashed while running `rid` under `lease`; True if that counts: the
        request is unfinished, still under that lease, its group not dropped, and the worker
        is one it had not crashed before (a worker restarted under its name counts once)."""
        r = self.requests.get(rid)
        if r is None or r.done or lease != r.lease or r.prompt_index in self.quarantined:
            return False
        if worker_id not in r.crashed_on:
            r.crashed_on.append(worker_id)
        return True

    def quarantine(self, prompt_index: int) -> None:
        """Drop a group from the step: it no longer holds the step up."""
        if prompt_index not in self.quarantined:
            self.unfinished_count -= sum(1 for r in self.group(prompt_index) if not r.done)
        self.quarantined.add(prompt_index)
        self.pending_groups.discard(prompt_index)

    def apply(self, item: DeltaItem, version: int | None = None) -> Applied:
        """Take a delta generated by weight `version` (None: the table's)."""
        result = self._apply(item, self.version if version is None else version)
        self.stats[result.value] += 1
        return result

    def _apply(self, item: DeltaItem, version: int) -> Applied:
        self.tokens_received += len(item.token_ids)
        r = self.requests.get(item.request_id)
        if r is None:
            return Applied.UNKNOWN
        if item.lease != r.lease:
            return Applied.STALE_LEASE
        if r.done:
            return Applied.ALREADY_DONE
        have = len(r.token_ids)
        if item.offset > have:
            return Applied.GAP
        skip = have - item.offset
        room = r.max_new_tokens - have
        new_tokens, new_logprobs = item.token_ids, item.logprobs
        if skip or len(new_tokens) > room:  # copies only when something is cut off
            new_tokens = new_tokens[skip : skip + room]
            new_logprobs = new_logprobs[skip : skip + room]
        n = len(new_tokens)
        if n and (not r.version_runs or r.version_runs[-1][1] != version):
            r.version_runs.append((have, version))
        r.token_ids.extend(new_tokens)
        r.logprobs.extend(new_logprobs)
        self.tokens_appended += n
        if item.finished or n >= room:
            r.finish_reason = item.finish_reason or "length"
            self._finished(r)
            return Applied.FINISHED
        return Applied.APPENDED if n else Applied.DUPLICATE

    def _finished(self, r: RequestState) -> None:
        if r.prompt_index not in self.quarantined:
            self.unfinished_count -= 1

    def group(self, prompt_index: int) -> list[RequestState]:
        return [
            self.requests[request_id(self.step, prompt_index, s)] for s in range(self.group_size)
        ]

    def group_done(self, prompt_index: int) -> bool:
        return all(r.done for r in self.group(prompt_index))

    def unfinished(self) -> list[str]:
        """Requests still to generate (those of quarantined groups are not)."""
        return [
            rid
            for rid, r in self.requests.items()
            if not r.done and r.prompt_index not in self.quarantined
        ]

    @property
    def complete(self) -> bool:
        return not self.pending_groups

    # -- groups for the trainer ---------------------------------------------------------------

    def score(self, rewards: dict[str, float]) -> None:
        for rid, reward in rewards.items():
            self.requests[rid].reward = reward

    def completed_groups(self, finished: list[str]) -> list[int]:
        """The still pending groups that the responses `finished` completed, in prompt order."""
        touched = {self.requests[rid].prompt_index for rid in finished}
        return [p for p in sorted(touched) if p in self.pending_groups and self.group_done(p)]

    def mark_published(self, prompt_indexes: list[int]) -> None:
        self.pending_groups.difference_update(prompt_indexes)

    def group_message(self, prompt_index: int) -> Group:
        """A completed group as the trainer gets it (every response finished and scored)."""
        responses = [
            Response(
                token_ids=m.token_ids,
                logprobs=m.logprobs,
                reward=_scored(m),
                finish_reason=m.finish_reason or "length",
                leases=m.lease + 1,
                version_runs=list(m.version_runs),
            )
            for m in self.group(prompt_index)
        ]
        return self._group_of(prompt_index, responses)

    def dropped_group(self, prompt_index: int) -> Group:
        """What the trainer gets for a quarantined group: no responses."""
        return self._group_of(prompt_index, [], quarantined=True)

    def _group_of(
        self, prompt_index: int, responses: list[Response], quarantined: bool = False
    ) -> Group:
        return Group(
            run_id=self.run_id,
            step=self.step,
            version=self.version,
            prompt_index=prompt_index,
            prompt_ids=self.prompts[prompt_index],
            responses=responses,
            quarantined=quarantined,
        )

    def mean_reward(self) -> float:
        """Mean reward of the scored responses of the groups that go to the trainer."""
        trained = [
            r.reward
            for r in self.requests.values()
            if r.reward is not None and r.prompt_index not in self.quarantined
        ]
        return sum(trained) / max(1, len(trained))

    @property
    def response_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests.values())


def _scored(r: RequestState) -> float:
    if r.reward is None:
        raise ValueError(f"request {r.request_id} is in a group but was never scored")
    return r.reward
