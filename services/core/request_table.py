"""Bookkeeping of the requests of one step: which tokens each response has, under which lease,
and which groups are complete. Pure: no Redis, no clock.

Rules it enforces:
- a delta is applied only for the request's current lease (fencing); older leases are dropped;
- every lease has a grant, a random secret its job carries: a delta or a release under the
  current lease is taken only with that grant (it proves the sender read the job); one without
  it is refused and counted (`Applied.WRONG_GRANT`);
- every token keeps the weight version that generated it (its delta batch's), as runs;
- tokens are appended once: a delta's offset must continue the response; a delta that repeats
  tokens already held is trimmed to its new part; one that leaves a gap is refused;
- a response is finished once, and then never changes;
- migrating bumps the lease and continues from the collected tokens, or, with migration off,
  discards them and starts over (the baseline that token-level collection improves on);
- a request that was running when a worker crashed is a suspect: its jobs run isolated (alone on
  a worker) from then on; a group that was quarantined (dropped from the step) is complete and
  none of its requests moves again.

Drafts (`drafts` on): every job, the first and each continuation, carries as references the
earlier responses to its prompt in the run (`history`, by prompt index, oldest first; the
coordinator reads them from `coordinator.step.history` when the step opens) and then its group's
finished siblings, newest last, the latest of them within `MAX_DRAFT_REFERENCES` and
`JOB_DRAFT_TOKENS`. With `length_aware`, the step's first jobs go longest expected response first
(`expected_length`: the mean length of the prompt's history). Off, jobs are what they were before
either existed.
"""

import zlib
from collections.abc import Iterable, Mapping, Sequence

from services.contracts.messages import (
    MAX_DRAFT_REFERENCES,
    DeltaItem,
    FinishReason,
    Group,
    Job,
    Response,
)
from services.contracts.sampling import SamplingParams
from services.contracts.shards import shard_of_prompt
from services.core.request_state import Applied, RequestState, request_id
from services.core.request_state import step_of as step_of  # re-exported

# the draft tokens one job carries at most (`Job.drafts` allows more): siblings and history of a
# long-response task fill it, and every job of a step is on its stream until the step is trained
JOB_DRAFT_TOKENS = 8192


class RequestTable:
    def __init__(
        self,
        run_id: str,
        step: int,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        stop_token_ids: list[int],
        shard: int = 0,
        shards: int = 1,
        *,
        drafts: bool = False,
        history: Mapping[int, list[list[int]]] | None = None,
        length_aware: bool = False,
    ) -> None:
        """The requests of the prompts of `shard` of `shards` (`contracts.shards`): all of them
        with one shard; `prompts` are always the step's all, by index. Each response gets
        `sampling.max_new_tokens` tokens at most. `history`: earlier responses to the prompts
        (prompt index -> token lists, oldest first), for `drafts` and `length_aware`."""
        self.drafts, self.length_aware = drafts, length_aware
        self.history: Mapping[int, list[list[int]]] = history or {}
        self.run_id, self.step = run_id, step
        self.shard, self.shards = shard, shards
        self.group_size = group_size
        self.sampling = sampling
        self.stop_token_ids = stop_token_ids
        self.requests: dict[str, RequestState] = {}
        self.prompts = prompts
        mine = [p for p in range(len(prompts)) if shard_of_prompt(p, shards) == shard]
        for p in mine:
            prompt_ids = prompts[p]
            for s in range(group_size):
                rid = request_id(step, p, s)
                self.requests[rid] = RequestState(
                    rid,
                    p,
                    s,
                    prompt_ids,
                    sampling.max_new_tokens,
                    seed=zlib.crc32(f"{seed}:{step}:{p}:{s}".encode()),
                )
        self.pending_groups = set(mine)
        # each group's requests by sample index, and the drafts from its history (made once)
        self._groups = {
            p: [self.requests[request_id(step, p, s)] for s in range(group_size)] for p in mine
        }
        self._earlier: dict[int, list[list[int]]] = {}
        self.groups = len(mine)  # the groups of this table's shard
        self.unfinished_count = len(self.requests)  # len(unfinished()), kept up to date
        self.quarantined: set[int] = set()  # groups dropped from the step (poison requests)
        self.stats = {a.value: 0 for a in Applied}
        self.tokens_appended = 0  # tokens that are now part of a response
        self.tokens_received = 0  # every token delivered in a delta, stale or repeated included
        self.tokens_discarded = 0  # collected tokens thrown away by restarts (migration off)
        self.migrations: dict[str, int] = {}  # by cause
        # speculative decoding behind the tokens appended (`DeltaItem.drafted`): forward
        # passes that verified a draft, draft tokens verified, of them kept
        self.draft_forwards = self.drafted = self.accepted = 0

    def requests_of_shard(self, shard: int) -> int:
        """The requests of the step that coordinator shard `shard` holds (its prompts' groups)."""
        prompts = range(len(self.prompts))
        return self.group_size * sum(1 for p in prompts if shard_of_prompt(p, self.shards) == shard)

    def job(self, rid: str) -> Job:
        """The job that continues request `rid` from what has been collected, under its lease."""
        r = self.requests[rid]
        return Job(
            run_id=self.run_id,
            request_id=rid,
            lease=r.lease,
            grant=r.grant,
            step=self.step,
            prompt_ids=r.prompt_ids,
            prefix_ids=list(r.token_ids),
            remaining_tokens=max(1, r.remaining),
            sampling=self.sampling,
            seed=r.seed,
            stop_token_ids=self.stop_token_ids,
            isolate=bool(r.crashed_on),
            shards=self.shards,
            drafts=self.draft_references(r) if self.drafts else [],
        )

    def draft_references(self, r: RequestState) -> list[list[int]]:
        """What `r`'s job drafts from: its prompt's history, then its group's finished
        siblings (by sample index), the latest within the job's bounds."""
        earlier = self._earlier.get(r.prompt_index)
        if earlier is None:  # shared by the group's jobs: a step's first jobs are many
            earlier = self._earlier[r.prompt_index] = latest_within(
                self.history.get(r.prompt_index, ())
            )
        group = self._groups[r.prompt_index]
        siblings = [m.token_ids for m in group if m is not r and m.done and m.token_ids]
        return latest_within([*earlier, *siblings]) if siblings else earlier

    def expected_length(self, prompt_index: int) -> float | None:
        """The mean length of the prompt's earlier responses; None without history."""
        earlier = self.history.get(prompt_index)
        return sum(map(len, earlier)) / len(earlier) if earlier else None

    def initial_jobs(self) -> list[Job]:
        """Every request's first job; with `length_aware`, groups by expected length, longest
        first (prompts without history first of all: any of them may be the longest), each
        group's requests together, the prompt order kept among equals."""
        rids: Iterable[str] = self.requests
        if self.length_aware:
            expected = {
                p: self.expected_length(p) for p in {r.prompt_index for r in self.requests.values()}
            }

            def rank(rid: str) -> tuple[int, float]:
                length = expected[self.requests[rid].prompt_index]
                return (0, 0.0) if length is None else (1, -length)

            rids = sorted(self.requests, key=rank)
        return [self.job(rid) for rid in rids]

    def migrate(
        self, rid: str, cause: str, keep_tokens: bool = True, lease: int | None = None
    ) -> Job | None:
        """Bump the lease of an unfinished request and return the job that continues it.

        With `lease` given, only a request still under that lease moves (a release or a reclaim
        that comes after another migration is a no-op). With `keep_tokens` False the collected
        tokens are discarded and the request starts over.
        """
        r = self.requests.get(rid)
        if r is None or r.done or r.awaiting or (lease is not None and lease != r.lease):
            return None
        if r.prompt_index in self.quarantined:
            return None
        r.next_lease()
        if not keep_tokens:
            # the generated ones: observations were never received from a worker
            self.tokens_discarded += len(r.token_ids) - sum(n for _, n in r.observed)
            r.token_ids, r.logprobs, r.version_runs, r.observed = [], [], [], []
            self._restarted(rid)
        self.migrations[cause] = self.migrations.get(cause, 0) + 1
        return self.job(rid)

    def _restarted(self, rid: str) -> None:
        """`rid` starts over from nothing (multi-turn: its episode too)."""

    def wrong_grant(self, rid: str, lease: int, grant: str) -> bool:
        """Whether a message naming `rid` under `lease` must be refused: the lease is the
        request's current one but `grant` is not its grant (the sender never read the job).
        Any other mismatch (an old lease, a request not here) is for the caller's usual
        checks."""
        r = self.requests.get(rid)
        return r is not None and lease == r.lease and grant != r.grant

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
        """Take a delta generated by weight `version` (None: the step's own)."""
        return self.apply_all([item], version)[0]

    def apply_all(self, items: list[DeltaItem], version: int | None = None) -> list[Applied]:
        """Take deltas generated by weight `version` (None: the step's own), in order; the
        outcome of each. This runs for every delta of a run: names are looked up once and
        the counts added once."""
        version = self.step if version is None else version
        requests = self.requests
        outcomes: list[Applied] = []
        outcome = outcomes.append
        received = appended = 0
        for item in items:
            new_tokens = item.token_ids
            n = len(new_tokens)
            received += n
            r = requests.get(item.request_id)
            if r is None:
                outcome(Applied.UNKNOWN)
                continue
            if item.lease != r.lease:
                outcome(Applied.STALE_LEASE)
                continue
            if item.grant != r.grant:
                outcome(Applied.WRONG_GRANT)
                continue
            if r.finish_reason is not None or r.awaiting is not None:
                outcome(Applied.ALREADY_DONE)
                continue
            tokens = r.token_ids
            have = len(tokens)
            skip = have - item.offset
            if skip < 0:
                outcome(Applied.GAP)
                continue
            room = r.max_new_tokens - have
            new_logprobs = item.logprobs
            if skip or n > room:  # copies only when something is cut off
                new_tokens = new_tokens[skip : skip + room]
                new_logprobs = new_logprobs[skip : skip + room]
                n = len(new_tokens)
            if n:
                runs = r.version_runs
                if not runs or runs[-1][1] != version:
                    runs.append((have, version))
                tokens.extend(new_tokens)
                r.logprobs.extend(new_logprobs)
                appended += n
                if item.draft_forwards:  # counted once, with the tokens they made
                    self.draft_forwards += item.draft_forwards
                    self.drafted += item.drafted
                    self.accepted += item.accepted
            if item.finished or n >= room:
                outcome(self._ended(r, item.finish_reason or "length"))
            else:
                outcome(Applied.APPENDED if n else Applied.DUPLICATE)
        self.tokens_received += received
        self.tokens_appended += appended
        stats = self.stats
        for result in outcomes:
            # `_value_`, not `value`: Enum's `value` is a property (a call per delta)
            stats[result._value_] += 1
        return outcomes

    def _ended(self, r: RequestState, reason: FinishReason) -> Applied:
        """The job ended (a stop token, or the token budget): the response is finished
        (multi-turn: the turn is over, `core.episodes.EpisodeTable`)."""
        r.finish_reason = reason
        self._finished(r)
        return Applied.FINISHED

    def _finished(self, r: RequestState) -> None:
        if r.prompt_index not in self.quarantined:
            self.unfinished_count -= 1

    def group(self, prompt_index: int) -> list[RequestState]:
        return list(self._groups[prompt_index])

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
                observed=list(m.observed),
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


def latest_within(
    references: Sequence[Sequence[int]],
    max_references: int = MAX_DRAFT_REFERENCES,
    max_tokens: int = JOB_DRAFT_TOKENS,
) -> list[list[int]]:
    """The latest of `references` within `max_references` and `max_tokens` tokens in all (the
    one that would pass the token bound cut to its head), oldest first; empty ones dropped."""
    kept: list[list[int]] = []
    room = max_tokens
    for ref in reversed(references):
        if len(kept) == max_references or room <= 0:
            break
        if ref:  # a list that fits is kept as it is: the jobs of a group share their drafts
            kept.append(ref if isinstance(ref, list) and len(ref) <= room else list(ref[:room]))
            room -= len(kept[-1])
    kept.reverse()
    return kept


def _scored(r: RequestState) -> float:
    if r.reward is None:
        raise ValueError(f"request {r.request_id} is in a group but was never scored")
    return r.reward
