"""One engine, several runs at once (issue 52): a worker serves each run it holds through a
`RunView` of one `SharedEngine`, and one decode step generates for all of them together.

Each run's part of the worker (its jobs, tokens, fencing, weight versions: `lanes`) sees its
view as an engine of its own. The shared engine keeps the runs apart:
- Request ids are per run ("step:prompt:sample"): the engine holds each request under
  "{run}/{id}", and a step's tokens come back per run under their own ids.
- Adapters are per run and version: each (run, version) gets an adapter number of its own, and
  a request is added under its run's newest. The adapter a run adds its requests under is kept
  even where no running request uses it (`Engine.keep_adapters`), so another run's load never
  pushes it out.
- The base is shared: a run's base is loaded once and kept while another run's requests or
  adapters are on it. A run that loads the base another run holds (the same content digest)
  loads nothing; one that loads other weights while another run is served is refused.

Sampling is by (request seed, position) and each row of a batch is computed on its own, so a
request's tokens are the same whichever other runs' requests share its steps.

It decides nothing about which runs a worker serves (`lanes` does) and runs no loop.
"""

from pathlib import Path

import msgspec

from services.contracts.messages import Job
from services.rollout.engines.base import BASE_ONLY, Engine, TokenEvent

SEP = "/"  # between a run and a request id, in the engine's id of a request


class SharedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.views: dict[str, RunView] = {}
        self.owners: dict[str, tuple[str, str]] = {}  # engine id -> (run, request id)
        # the content digest of the base held, under adapters of the runs served (None: not
        # known, or full weights of one run, or an adapter merged into the base)
        self.base: str | None = None
        # the folder of the base the weights held were loaded from (an adapter merged into it
        # or not): it lends its files to the next run on that base, and stays while it does
        self.base_folder: Path | None = None
        self._adapter_ids: dict[tuple[str, int], int] = {}  # (run, version) -> adapter number
        self._next_adapter = 1

    @property
    def active(self) -> int:
        return self.engine.active

    def view(self, run_id: str) -> "RunView":
        """The view of run `run_id` (made on its first call)."""
        if SEP in run_id:
            raise ValueError(f"a run id holds no {SEP!r}: {run_id!r}")
        if run_id not in self.views:
            self.views[run_id] = RunView(self, run_id)
        return self.views[run_id]

    def close_view(self, run_id: str) -> None:
        """The worker no longer serves `run_id`: its requests stop, its adapters may go."""
        view = self.views.pop(run_id, None)
        if view is not None:
            view.abort_all()
        self._adapter_ids = {k: n for k, n in self._adapter_ids.items() if k[0] != run_id}
        self.keep_newest()

    async def step(self) -> dict[str, list[TokenEvent]]:
        """One engine step: the tokens generated, per run, under the runs' own request ids."""
        events: dict[str, list[TokenEvent]] = {}
        for event in await self.engine.step():
            owner = self.owners.get(event.request_id)
            if owner is None:  # aborted since the step began
                continue
            run_id, request_id = owner
            if event.finish_reason is not None:
                del self.owners[event.request_id]
                self.views[run_id].ids.pop(request_id, None)
            event.request_id = request_id
            events.setdefault(run_id, []).append(event)
        return events

    def others_served(self, run_id: str) -> bool:
        """Whether a run other than `run_id` holds requests or adapters on the engine."""
        return any(r != run_id for r, _ in self.owners.values()) or any(
            r != run_id for r, _ in self._adapter_ids
        )

    def adapter_id(self, run_id: str, version: int) -> int | None:
        """The engine's number of `run_id`'s adapter `version` (None: not loaded)."""
        return self._adapter_ids.get((run_id, version))

    def new_adapter_id(self, run_id: str, version: int) -> int:
        """A new number for `run_id`'s adapter `version`, about to be loaded (again: after a
        pause, a number of its own, so the load never replaces one that requests use)."""
        number = self._adapter_ids[(run_id, version)] = self._next_adapter
        self._next_adapter += 1
        return number

    def forget_adapter(self, run_id: str, version: int, number: int) -> None:
        """`number` never loaded (the engine refused it)."""
        if self._adapter_ids.get((run_id, version)) == number:
            del self._adapter_ids[(run_id, version)]
        self.keep_newest()

    def forget_adapters(self) -> None:
        """A whole load dropped every adapter the engine held."""
        self._adapter_ids.clear()
        for view in self.views.values():
            view.newest = None
        self.keep_newest()

    def keep_newest(self) -> None:
        """Tell the engine which adapters to keep: each run's newest."""
        self.engine.keep_adapters = {
            self._adapter_ids[(v.run_id, v.newest)]
            for v in self.views.values()
            if v.newest is not None and (v.run_id, v.newest) in self._adapter_ids
        }


class RunView:
    """The engine as one run's part of a worker sees it: its own requests, adapters and base
    (the `Engine` interface, but for `step`, which the worker takes on the shared engine)."""

    def __init__(self, shared: SharedEngine, run_id: str) -> None:
        self.shared, self.run_id = shared, run_id
        self.ids: dict[str, str] = {}  # request id -> engine id, of this run's running ones
        self.newest: int | None = None  # the adapter version requests are added under

    @property
    def name(self) -> str:
        return self.shared.engine.name

    @property
    def capacity(self) -> int:
        return self.shared.engine.capacity

    @property
    def max_adapters(self) -> int:
        return self.shared.engine.max_adapters

    @property
    def active(self) -> int:
        return len(self.ids)

    async def load(self, folder: Path, changed: frozenset[str] | None = None) -> None:
        """Whole weights of this run (or tensors of them, in place): only where no other run
        is served on the engine; every request of this run stops, as `Engine.load` says."""
        shared = self.shared
        if shared.others_served(self.run_id):
            raise ValueError(
                f"run {self.run_id}: its weights cannot load while other runs are served on "
                "this engine (only LoRA runs on one base share an engine)"
            )
        self.abort_all()
        await shared.engine.load(folder, changed)
        shared.base = None
        if changed is None:  # tensors in place (merged into the base) keep the base's folder
            shared.base_folder = None
        shared.forget_adapters()

    async def load_base(self, folder: Path, digest: str) -> None:
        """The base this run's adapters apply on: nothing to load where the engine holds that
        content already (another run's base, or this run's before a pause); else loaded whole,
        only where no other run is served."""
        shared = self.shared
        if shared.base != digest:
            await self.load(folder)
        # the same content: this run's folder serves as the base's from now on (the run whose
        # folder it was may end and take it along)
        shared.base, shared.base_folder = digest, Path(folder)

    async def load_adapter(self, version: int, folder: Path) -> None:
        """Hold this run's adapter `version`: its requests are added under it from now on.
        The one they were added under before may make room for it (the others' may not)."""
        shared, newest = self.shared, self.newest
        self.newest = None
        shared.keep_newest()
        number = shared.new_adapter_id(self.run_id, version)
        try:
            await shared.engine.load_adapter(number, folder)
        except BaseException:
            self.newest = newest
            shared.forget_adapter(self.run_id, version, number)
            raise
        self.newest = version
        shared.keep_newest()

    def add(self, job: Job, adapter: int | None = None) -> None:
        version = self.newest if adapter is None else adapter
        # no adapter of this run held (its version 0, the base): the base alone, whatever
        # adapters other runs hold
        number = BASE_ONLY if version is None else self.shared.adapter_id(self.run_id, version)
        if number is None:
            raise ValueError(f"{job.request_id}: no adapter held for version {version}")
        engine_id = f"{self.run_id}{SEP}{job.request_id}"
        self.shared.engine.add(msgspec.structs.replace(job, request_id=engine_id), number)
        self.ids[job.request_id] = engine_id
        self.shared.owners[engine_id] = (self.run_id, job.request_id)

    def fits(self, job: Job) -> bool:
        return self.shared.engine.fits(job)

    def abort(self, request_id: str) -> bool:
        engine_id = self.ids.pop(request_id, None)
        if engine_id is None:
            return False
        self.shared.owners.pop(engine_id, None)
        return self.shared.engine.abort(engine_id)

    def abort_all(self) -> list[str]:
        ids = list(self.ids)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def tokens_left(self, request_id: str) -> int:
        engine_id = self.ids.get(request_id)
        return self.shared.engine.tokens_left(engine_id) if engine_id is not None else 0

    def set_drafts(self, request_id: str, drafts: list[list[int]]) -> None:
        engine_id = self.ids.get(request_id)
        set_drafts = getattr(self.shared.engine, "set_drafts", None)
        if engine_id is not None and set_drafts is not None:
            set_drafts(engine_id, drafts)

    @property
    def drafts(self) -> bool:
        """Whether the engine drafts (`set_drafts`)."""
        return hasattr(self.shared.engine, "set_drafts")

    async def pause(self) -> None:
        """This run steps aside: its requests stop. The engine frees its memory (and may drop
        its weights) only where no other run is served on it."""
        self.abort_all()
        if not self.shared.others_served(self.run_id):
            await self.shared.engine.pause()
            self.shared.base, self.shared.base_folder = None, None

    async def close(self) -> None:
        self.abort_all()
