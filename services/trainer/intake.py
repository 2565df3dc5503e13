"""What one RL step takes of the groups stream, decided group by group, with no I/O: the trainer
loop reads, asks `StepIntake.take` which groups to train on, parks the refused ones and trains.

A group is refused (parked, with the reason) when it is of an earlier step (or one past the
steps in flight), of a prompt the step already took (it came twice: never trained twice), has
another number of responses than n, or has a response whose observation spans do not fit its
tokens (`Response.observed`: out of order, overlapping, empty or past its end). A group of a
later step in flight (asynchronous RL: steps s+1..s+k are generated while s trains) is held,
unacknowledged, for its own step: `ahead`. A quarantined group (a request of it crashed too many
workers) counts toward the step's B and is never trained on. Every entry the step takes or
refuses is kept, to be acknowledged once the step's version is committed; the trained ledger and
the groups for the rollout dump are built on the way.
"""

import logging
from dataclasses import dataclass, field

from prometheus_client import Counter

from services.contracts.messages import Group
from services.contracts.spans import span_error
from services.infra.redis_streams import Read
from services.state.ledger import StepLedger

log = logging.getLogger(__name__)
GROUPS = Counter("spotrl_trainer_groups_total", "Groups consumed", ["outcome"])


@dataclass
class StepIntake:
    run_id: str
    step: int
    prompts: int  # B: groups the step trains on or drops
    group_size: int  # n: responses a group must have
    ledger: StepLedger = field(default_factory=StepLedger)
    kept: list[Group] = field(default_factory=list)  # trained and quarantined: the dump's
    entry_ids: list[bytes] = field(default_factory=list)  # every entry read, in order
    trained: int = 0
    dropped: int = 0  # quarantined groups
    staleness: int = 0  # max_staleness: groups of steps step+1 .. step+k are held
    ahead: list[tuple[bytes, Group]] = field(default_factory=list)  # held for later steps

    @property
    def missing(self) -> int:
        """Groups the step still waits for."""
        return self.prompts - self.trained - self.dropped

    @property
    def last_entry(self) -> str | None:
        """The id of the newest entry read (a checkpoint's data position)."""
        return self.entry_ids[-1].decode() if self.entry_ids else None

    def take(self, read: Read[Group]) -> list[Group]:
        """The groups of one read to train on now; the refused ones go to `read.parked`, those
        of a later step in flight to `ahead`."""
        later = {
            entry_id
            for entry_id, group in read.messages
            if self.step < group.step <= self.step + self.staleness
        }
        self.entry_ids.extend(i for i in read.ids if i not in later)
        good = []
        for entry_id, group in read.messages:
            if entry_id in later:
                self.ahead.append((entry_id, group))
                continue
            refusal = self._refusal(group)
            if refusal is not None:
                read.parked.append((entry_id, refusal))
            elif group.quarantined:
                self.ledger.quarantined.add(group.prompt_index)
                self.kept.append(group)
                self.dropped += 1
                GROUPS.labels("quarantined").inc()
                log.warning(
                    "run %s step %d: group %d was quarantined",
                    self.run_id,
                    self.step,
                    group.prompt_index,
                )
            else:
                self.ledger.add(group)
                good.append(group)
        self.trained += len(good)
        self.kept += good
        GROUPS.labels("trained").inc(len(good))
        return good

    def _refusal(self, group: Group) -> str | None:
        """Why the step does not take `group` (None: it does), counted in the ledger."""
        if group.step != self.step:
            return f"group of step {group.step} during step {self.step}"
        if self.ledger.seen(group.prompt_index):
            self.ledger.duplicates += 1
            GROUPS.labels("duplicate").inc()
            return f"group {group.prompt_index} came twice"
        if not group.quarantined and len(group.responses) != self.group_size:
            self.ledger.incomplete += 1
            GROUPS.labels("incomplete").inc()
            return f"{len(group.responses)} responses, want n={self.group_size}"
        for i, resp in enumerate(group.responses):
            error = span_error(resp.observed, len(resp.token_ids))
            if error is not None:
                GROUPS.labels("malformed").inc()
                reason = f"response {i} of group {group.prompt_index}: observed {error}"
                log.warning("run %s step %d: parking a group: %s", self.run_id, self.step, reason)
                return reason
        return None
