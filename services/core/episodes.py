"""Multi-turn episodes on a step's request table (issue 40): a response is a trajectory of model
turns and the environment's observations between them, collected token by token as ever.

A model turn is a job like any other: its deltas are fenced by lease and appended once, and it
migrates between workers token by token. When it ends (a stop token, or the token budget), the
request does not finish: it waits for the environment (`RequestState.awaiting`), and no job of it
is out. The environment's answer (`Observation`) comes back through `observe`:
- the episode goes on: the observation's tokens are appended as *not generated* (a span in
  `RequestState.observed`: masked out of the loss, placeholder logprobs), the lease is bumped and
  the continuation job (prompt, every token so far, what is left of the budget) is returned: the
  next turn is queued as any continuation is, so it may run on any worker;
- the episode is over (the environment says so, `max_turns` turns were taken, or no room is left
  in the token budget for the observation and one more token): the response finishes, its reward
  the sum of its turns' rewards (the documented rule).
The budget (`max_new_tokens` of the run's sampling) counts every token of the trajectory, the
observations' too: it bounds the context a trajectory grows to. Pure: no Redis, no environment
code (the coordinator's shell runs the environment and calls `observe`).
"""

import json
from dataclasses import dataclass, field

from services.contracts.messages import FinishReason, Job
from services.core.request_table import Applied, RequestState, RequestTable


@dataclass(frozen=True)
class Observation:
    """The environment's answer to a model turn, as the table takes it."""

    token_ids: list[int]  # the observation as the model reads it (chat markup included)
    reward: float  # this turn's reward contribution
    done: bool  # the environment ends the episode
    text: str = ""  # the observation as the environment wrote it
    role: str = "tool"  # as a chat message: "tool" or "user"


@dataclass
class Episode:
    """What a request's episode holds besides its tokens."""

    turns: int = 1  # model turns begun
    rewards: list[float] = field(default_factory=list)  # each judged turn's contribution
    said: list[tuple[str, str]] = field(default_factory=list)  # each answer's (role, text)
    # where each model turn begins and ends in the response's tokens (an ended turn has both)
    starts: list[int] = field(default_factory=lambda: [0])
    ends: list[int] = field(default_factory=list)

    def to_json(self, r: RequestState) -> str:
        """The episode and its request's multi-turn state, as the step's store keeps them."""
        return json.dumps(
            {
                "turns": self.turns,
                "rewards": self.rewards,
                "said": self.said,
                "starts": self.starts,
                "ends": self.ends,
                "observed": r.observed,
                "awaiting": r.awaiting,
            }
        )

    @classmethod
    def restore(cls, raw: str | bytes, r: RequestState) -> "Episode":
        """An episode stored by `to_json`, its request's state set again."""
        got = json.loads(raw)
        r.observed = [(int(o), int(n)) for o, n in got["observed"]]
        r.awaiting = got["awaiting"]
        said = [(str(role), str(text)) for role, text in got["said"]]
        episode = cls(
            int(got["turns"]),
            [float(x) for x in got["rewards"]],
            said,
            [int(x) for x in got["starts"]],
            [int(x) for x in got["ends"]],
        )
        if r.done:  # a finished episode's reward is its turns'
            r.reward = sum(episode.rewards)
        return episode


@dataclass
class EpisodeStats:
    """A step's episodes so far, for its metrics row."""

    turns: int = 0  # model turns answered
    episodes: int = 0  # episodes over
    tool_calls: int = 0
    tool_errors: int = 0  # tool calls that failed, and markup that did not parse
    errors: int = 0  # environment calls that failed (raised, timed out, crashed, bad)
    seconds: float = 0.0  # environment time (calls in parallel count once)
    by_error: dict[str, int] = field(default_factory=dict)


class EpisodeTable(RequestTable):
    """A request table whose responses are multi-turn episodes of at most `max_turns` model
    turns."""

    def __init__(self, *args, max_turns: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, not {max_turns}")
        self.max_turns = max_turns
        self.episodes = {rid: Episode() for rid in self.requests}

    def _restarted(self, rid: str) -> None:
        self.episodes[rid] = Episode()  # without migration an episode starts over whole

    def _ended(self, r: RequestState, reason: FinishReason) -> Applied:
        r.awaiting = reason
        self.episodes[r.request_id].ends.append(len(r.token_ids))
        return Applied.TURN_ENDED

    def awaiting(self) -> list[str]:
        """The requests whose last turn waits for the environment (after a restart: each is
        asked again; environments are functions of the row and the history)."""
        return [
            rid
            for rid, r in self.requests.items()
            if r.awaiting is not None and r.prompt_index not in self.quarantined
        ]

    def turns(self, rid: str) -> list[list[int]]:
        """The tokens of each model turn of `rid`, in order (the last one as far as it got)."""
        tokens, episode = self.requests[rid].token_ids, self.episodes[rid]
        ends = [*episode.ends, len(tokens)][: len(episode.starts)]
        return [tokens[start:end] for start, end in zip(episode.starts, ends, strict=True)]

    def observe(self, rid: str, lease: int, answer: Observation) -> Job | None:
        """The environment answered the last turn of `rid` (under `lease`): the job of its next
        turn, or None when the episode is over (then `rid` is finished and scored) or the
        answer is stale (not awaited, or for another lease)."""
        r = self.requests.get(rid)
        if r is None or r.awaiting is None or lease != r.lease or r.done:
            return None
        episode = self.episodes[rid]
        episode.rewards.append(answer.reward)
        episode.said.append((answer.role, answer.text))
        room = r.max_new_tokens - len(r.token_ids) - len(answer.token_ids)
        if answer.done or episode.turns >= self.max_turns or room < 1:
            r.finish_reason, r.awaiting = r.awaiting, None
            r.reward = sum(episode.rewards)
            self._finished(r)
            return None
        if answer.token_ids:  # an empty observation: the next turn follows at once
            r.observed.append((len(r.token_ids), len(answer.token_ids)))
        r.token_ids.extend(answer.token_ids)
        r.logprobs.extend([0.0] * len(answer.token_ids))
        r.awaiting = None
        r.next_lease()
        episode.turns += 1
        episode.starts.append(len(r.token_ids))
        return self.job(rid)

    def generated_tokens(self, rid: str) -> int:
        """The tokens of `rid` that the model generated (observations left out)."""
        r = self.requests[rid]
        return len(r.token_ids) - sum(length for _, length in r.observed)
