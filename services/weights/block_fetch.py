"""Fetching the blocks of one weight version into a partial folder from several sources at once:
the weight store and, given a `Swarm`, the peers that hold them. Every block is checked against
the sha256 the store's manifest gives it before it counts; a block that does not verify is
fetched again elsewhere, and its source is not used again for this version
(`block_sources.SourcePicker` decides where each block comes from).

With a swarm, the blocks go in an order of this puller's own (shuffled), so that pullers
starting together soon hold different blocks to trade; each block verified is announced to the
swarm at once, so that the peers can take it from here while the pull goes on.
"""

import asyncio
import logging
import random
import time
from collections import deque
from pathlib import Path
from typing import Protocol

from services.infra.cancel import cancel_and_wait
from services.weights.block_sources import Block, Holding, SourcePicker
from services.weights.contract import WeightTransferError
from services.weights.files import SourceBusy, SourceLacks, fetch_range

log = logging.getLogger(__name__)
HOLDERS_S = 0.2  # how often the swarm is asked who holds what, while a pull goes on
STORE_BUSY_S = 0.05  # wait before asking a busy store again
PEER_TIMEOUT_S = 10.0  # a peer that stalls this long is dropped (the store gets 60 s)


class Swarm(Protocol):
    """The peers of one pull (a model version), and this puller's place among them."""

    async def holders(self) -> dict[str, Holding]:
        """Peer base URL -> the blocks it holds verified (ALL: every one); not this puller."""
        ...

    async def begin(self, folder: Path, blocks: list[Block]) -> None:
        """The pull of these blocks into `folder` begins; nothing of it is verified yet."""
        ...

    async def verified(self, blocks: list[Block]) -> None:
        """These blocks are in `folder`, verified: peers may take them from here."""
        ...

    async def complete(self, folder: Path) -> None:
        """Every block is verified and the version is now whole in `folder`."""
        ...

    async def abandon(self) -> None:
        """The pull failed: offer nothing of it."""
        ...


class BlockFetch:
    """One attempt at the blocks of a version: `run` fetches them all or raises."""

    def __init__(
        self,
        store: str,
        files_path: str,
        folder: Path,
        headers: dict[str, str],
        parallel: int,
        swarm: Swarm | None = None,
        ca_file: Path | str | None = None,
    ) -> None:
        # sources are base URLs; a block of file f is at {source}{files_path}/{f}; an https://
        # source (the store's or a peer's server with a certificate) is verified against ca_file
        self.store, self.files_path, self.folder = store, files_path, folder
        self.headers, self.parallel, self.swarm = headers, parallel, swarm
        self.ca_file = ca_file
        self.picker = SourcePicker(store, per_peer=parallel)
        self.from_store = 0  # bytes
        self.from_peers = 0

    async def run(self, blocks: list[Block]) -> None:
        queue = deque(blocks)
        if self.swarm is not None:
            random.shuffle(queue)
            self.picker.update(await self.swarm.holders())

        async def drain() -> None:
            while queue:
                await self._fetch(queue.popleft())

        fetchers = [asyncio.create_task(drain()) for _ in range(min(self.parallel, len(blocks)))]
        watcher = asyncio.create_task(self._watch_holders()) if self.swarm is not None else None
        try:
            await asyncio.gather(*fetchers)
        finally:
            await cancel_and_wait([*fetchers, watcher])

    async def _watch_holders(self) -> None:
        assert self.swarm is not None
        while True:
            await asyncio.sleep(HOLDERS_S)
            try:
                self.picker.update(await self.swarm.holders())
            except Exception as exc:  # the store alone still completes the pull
                log.warning("could not learn which peers hold blocks: %s", exc)

    async def _fetch(self, block: Block) -> None:
        while True:
            source = self.picker.pick(block.index, time.monotonic())
            url = f"{source}{self.files_path}/{block.name}"
            timeout = 60.0 if source == self.store else PEER_TIMEOUT_S
            self.picker.started(source)
            try:
                await asyncio.to_thread(
                    fetch_range,
                    url,
                    self.folder / block.name,
                    block.start,
                    block.end,
                    block.sha256,
                    self.headers,
                    timeout,
                    self.ca_file,
                )
            except SourceBusy:
                self.picker.busy(source, time.monotonic())
                if source == self.store:
                    await asyncio.sleep(STORE_BUSY_S)
                continue
            except SourceLacks:
                if source == self.store:
                    raise  # the version is gone from the store (retention): this attempt fails
                self.picker.busy(source, time.monotonic())  # until the holders say otherwise
                continue
            except WeightTransferError as exc:
                if source == self.store:
                    raise
                if source not in self.picker.dropped:
                    log.warning("not using peer %s for this version: %s", source, exc)
                self.picker.drop(source, str(exc))
                continue
            finally:
                self.picker.finished(source)
            if source == self.store:
                self.from_store += block.size
            else:
                self.from_peers += block.size
            if self.swarm is not None:
                await self.swarm.verified([block])
            return
