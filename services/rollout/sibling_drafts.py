"""Drafts refreshed as siblings finish, on the worker: a response that finishes here becomes a
draft reference of its group's requests still running here, and of those of its group that
start here later (Seer's grouped speculation, without a round trip).

A job arrives with the references the coordinator had when it made the job (the prompt's earlier
responses in the run, its group's siblings finished by then: `core.request_table`); siblings
that finish after that are in no job. Those that finish on this worker are in its hands at once:
`SiblingDrafts` follows the requests it runs (their jobs and the tokens generated here) and, as
one finishes, hands the engine the new references of each running sibling (`set_drafts`, from
its next step on). Nothing waits for a draft: a request drafts from what there is. The engine
verifies every draft against its own seeded draws, so this changes how fast, never which tokens.

Only in a run whose spec has drafts on (`keys.run_drafts`), and only with an engine that drafts
(one with `set_drafts`). Bounded: the requests it follows are the engine's; it keeps the
finished responses of the last `KEPT_GROUPS` groups, each within the job bounds
(`request_table.latest_within`).

Pure: no Redis, no clock.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.contracts.messages import Job
from services.core.request_table import latest_within
from services.rollout.engines.base import TokenEvent

KEPT_GROUPS = 64  # groups whose finished responses are kept for siblings that start later
SetDrafts = Callable[[str, list[list[int]]], None]


def group_of(job: Job) -> tuple[str, str]:
    """A job's group: its run, and "{step}:{prompt_index}" of its request id."""
    return job.run_id, job.request_id.rpartition(":")[0]


@dataclass
class _Running:
    job: Job
    tokens: list[int] = field(default_factory=list)  # generated here
    added: list[list[int]] = field(default_factory=list)  # siblings finished here since


class SiblingDrafts:
    def __init__(self, set_drafts: SetDrafts) -> None:
        self.set_drafts = set_drafts
        self.running: dict[str, _Running] = {}
        # group -> the responses finished here, oldest first
        self.finished: OrderedDict[tuple[str, str], list[list[int]]] = OrderedDict()

    def started(self, job: Job, holds: Callable[[str, int], bool]) -> None:
        """`job` starts on the engine: follow it (and no longer those the worker does not
        `holds(request_id, lease)`: aborted, released); it drafts from its group's responses
        that finished here too."""
        self._forget_gone(holds)
        run = self.running[job.request_id] = _Running(job)
        done = self.finished.get(group_of(job), [])
        run.added = [ref for ref in done if ref not in job.drafts]
        if run.added:
            self.set_drafts(job.request_id, self._references(run))

    def record(self, events: Iterable[TokenEvent], holds: Callable[[str, int], bool]) -> int:
        """The tokens of one engine step; each response finished among them handed to its
        running siblings (those the worker still `holds(request_id, lease)`). How many
        siblings got a new reference."""
        ended: list[_Running] = []
        for e in events:
            run = self.running.get(e.request_id)
            if run is None or run.job.lease != e.lease:
                continue
            run.tokens.append(e.token_id)
            if e.finish_reason is not None:
                ended.append(self.running.pop(e.request_id))
        if ended:
            self._forget_gone(holds)
        return sum(self._share(group_of(run.job), run.job.prefix_ids + run.tokens) for run in ended)

    def _forget_gone(self, holds: Callable[[str, int], bool]) -> None:
        for rid in [rid for rid, run in self.running.items() if not holds(rid, run.job.lease)]:
            del self.running[rid]

    def _share(self, group: tuple[str, str], response: list[int]) -> int:
        done = self.finished.setdefault(group, [])
        done[:] = latest_within([*done, response])
        self.finished.move_to_end(group)
        while len(self.finished) > KEPT_GROUPS:
            self.finished.popitem(last=False)
        refreshed = 0
        for rid, run in self.running.items():
            if group_of(run.job) == group and response not in run.job.drafts:
                run.added = latest_within([*run.added, response])
                self.set_drafts(rid, self._references(run))
                refreshed += 1
        return refreshed

    @staticmethod
    def _references(run: _Running) -> list[list[int]]:
        """The job's references, then the siblings finished here, newest last, in bounds."""
        return latest_within([*run.job.drafts, *run.added])

    def clear(self) -> None:
        self.running.clear()
        self.finished.clear()
