"""Where each block of a weight pull comes from: the store or a peer that holds it. Pure policy,
no I/O: the pull (services.weights.transfer) asks `pick` for a source, then reports what came of
the fetch.

A version's blocks are numbered over its files in manifest order (`plan_blocks`). A peer holds
some of them, verified (it is pulling the version too), or all (it pulled the version whole).
A block goes to the peer that holds it with the fewest of this puller's fetches under way,
below `per_peer` of them, and not refused as busy lately; the store when no peer qualifies.
Peers first: the store's egress is what a fleet runs short of. A peer that failed or served a
block that did not verify is dropped for the rest of this version; the store, the source of
truth, is never dropped (its failure fails the pull, which tries the next replica).
"""

import random
from dataclasses import dataclass, field

from services.weights.contract import FileEntry

ALL = None  # a holder of every block of the version


@dataclass(frozen=True)
class Block:
    index: int  # over the version's files in manifest order
    name: str  # file
    start: int  # first byte in the file
    end: int  # last byte, inclusive
    sha256: str

    @property
    def size(self) -> int:
        return self.end - self.start + 1


def plan_blocks(entries: list[FileEntry]) -> list[Block]:
    """The blocks of the files that have block hashes, numbered in manifest order (a file
    without them is fetched from the store only and checked whole)."""
    blocks: list[Block] = []
    for entry in entries:
        hashed = entry.blocks()
        if hashed is None:
            continue
        size, hashes = hashed
        for i, start in enumerate(range(0, entry.size, size)):
            end = min(start + size, entry.size) - 1
            blocks.append(Block(len(blocks), entry.name, start, end, hashes[i]))
    return blocks


Holding = frozenset[int] | None  # the block indexes a peer holds verified; ALL: every one


@dataclass
class SourcePicker:
    store: str
    per_peer: int = 2
    busy_s: float = 0.5  # a peer that answered busy is left alone this long
    rng: random.Random = field(default_factory=random.Random)
    holders: dict[str, Holding] = field(default_factory=dict)
    under_way: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # peer -> why
    busy_until: dict[str, float] = field(default_factory=dict)

    def update(self, holders: dict[str, Holding]) -> None:
        """What the peers hold now (the store is not one of them)."""
        self.holders = {url: held for url, held in holders.items() if url != self.store}

    def pick(self, index: int, now: float) -> str:
        """The source to fetch block `index` from now."""
        ready = [
            url
            for url, held in self.holders.items()
            if (held is ALL or index in held)
            and url not in self.dropped
            and self.busy_until.get(url, 0.0) <= now
            and self.under_way.get(url, 0) < self.per_peer
        ]
        if not ready:
            return self.store
        least = min(self.under_way.get(url, 0) for url in ready)
        return self.rng.choice([url for url in ready if self.under_way.get(url, 0) == least])

    def started(self, url: str) -> None:
        self.under_way[url] = self.under_way.get(url, 0) + 1

    def finished(self, url: str) -> None:
        self.under_way[url] -= 1

    def busy(self, url: str, now: float) -> None:
        self.busy_until[url] = now + self.busy_s

    def drop(self, url: str, why: str) -> None:
        """Use the peer `url` no more for this version (the store is never dropped)."""
        if url != self.store:
            self.dropped.setdefault(url, why)
