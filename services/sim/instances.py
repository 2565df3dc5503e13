"""The simulation's instances: the trace offering and taking back instances, the
scaler holding the pool the coordinator wants, boots, weight pulls (in the foreground at boot,
in the background under asynchronous RL), preemptions with or without notice, and their
detection when a dead instance's heartbeat expires; and the heartbeats the coordinator's step
controller reads (`Fleet.beats`).

What a preempted instance held goes through the services' own flush and reclaim code
(requests.py); what is modelled here is time and the cloud's choices (a random victim). The
component is `Fleet`, held by the simulation as `sim.fleet`; its events are `on_*` methods.
"""

import itertools
import random

from services.contracts.messages import DeltaBatch, Heartbeat
from services.sim.clock import Clock
from services.sim.engine import SimEngine
from services.sim.requests import RequestFlow
from services.sim.scenario import Payload, Route, Scenario
from services.sim.state import RUN_ID, Instance, Totals
from services.sim.systems import SystemSpec
from services.sim.tail import verify_step

REMOTE_SUFFIX = "@remote"  # ends the name of a spot instance in the remote region


def reserved_instances(sc: Scenario, system: SystemSpec) -> dict[str, Instance]:
    """The reserved nodes' engines, up from the start and paused (the step starts them)."""
    return {
        f"reserved-{i}": Instance(
            f"reserved-{i}",
            "reserved",
            SimEngine(sc.reserved_engine, verify_step(sc.reserved_engine, sc.tail.speculation)),
            0.0,
            0.0,
            state="up",
            paused=True,
        )
        for i in range(sc.reserved_engines * system.reserved_nodes)
    }


def is_remote(inst: Instance) -> bool:
    """Whether `inst` lives in another region than the weight store (`TransferModel`)."""
    return inst.name.endswith(REMOTE_SUFFIX)


class Fleet:
    """The instances, reserved and preemptible: what the cloud offers (`available`), the pool
    the coordinator wants, boots, pulls and preemptions. What a dying instance held goes to the
    requests' component (`requests`), which applies it as the coordinator does."""

    def __init__(
        self,
        clock: Clock,
        sc: Scenario,
        system: SystemSpec,
        totals: Totals,
        seed: int,
        instances: dict[str, Instance],
        requests: RequestFlow,
    ) -> None:
        self.clock, self.sc, self.system, self.totals = clock, sc, system, totals
        self.instances = instances  # the reserved engines (`reserved_instances`), then spot ones
        self.requests = requests
        self.rng = random.Random(f"{seed}:victims")  # the cloud's choice of victims
        self.spot_timeline: list[tuple[float, int]] = []  # the trace: instances offered
        self.available = 0  # instances the cloud offers now
        self.wanted: int | None = None  # the pool the coordinator asks for (None: all)
        self._names = itertools.count()
        # bytes this shard's pulls carried over the cross-region link (`TransferModel.link_bytes`)
        self.cross_region_bytes = 0.0
        # the latest version each payload crossed it in (the base's: 0, once a run)
        self.carried: dict[Payload, int] = {}

    def on_target(self, count: int) -> None:
        """The trace: the cloud now offers `count` instances. An instance it takes back is
        preempted (a random one of those held); a scaler holds min(offered, wanted)."""
        self.available = count
        self.spot_timeline.append((self.clock.now, count))
        self.hold(count if self.wanted is None else min(count, self.wanted), scale_in=False)

    def want(self, wanted: int | None) -> None:
        """The scaler follows the coordinator's `preemptible_wanted`, between steps (the pool
        is idle then: an instance handed back loses no work)."""
        self.wanted = wanted
        target = self.available if wanted is None else min(self.available, wanted)
        self.hold(target, scale_in=True)

    def hold(self, count: int, scale_in: bool) -> None:
        live = [i for i in self.pool_instances() if i.state != "noticed"]
        for _ in range(count - len(live)):
            index = next(self._names)
            name = f"spot-{index}"
            if self.sc.transfer.starts_remote(index):
                name += REMOTE_SUFFIX
            price = self.sc.cloud.spot_instance_per_h
            if self.system.pool == "fixed":
                price = self.sc.cloud.ondemand_instance_per_h
            profile = self.sc.spot_engine
            engine = SimEngine(profile, verify_step(profile, self.sc.tail.speculation))
            self.instances[name] = Instance(name, "preemptible", engine, price, self.clock.now)
            self.clock.at(self.clock.now + self.sc.cloud.startup_s, "booted", name)
        excess = max(0, len(live) - count)
        if not scale_in:
            for victim in self.rng.sample(live, excess):
                self.preempt(victim)
            return
        # handed back: those not serving yet first, then the newest
        order = {"booting": 0, "pulling": 1, "up": 2}
        live.sort(key=lambda i: (order.get(i.state, 3), -i.born_s))
        for inst in live[:excess]:
            self.requests.release(
                inst, len(inst.engine.running), "preemption"
            )  # none between steps
            self.totals.scaled_in += 1
            self.on_gone(inst.name)

    def pool_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == "preemptible" and i.state != "gone"]

    def reserved(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.pool == "reserved"]

    def on_booted(self, name: str) -> None:
        inst = self.instances[name]
        if inst.state == "booting":
            self.pull(inst)

    def pull(self, inst: Instance) -> None:
        inst.state = "pulling"
        self.clock.at(self.clock.now + self.pull_s(inst), "pulled", (inst.name, self.clock.version))

    def pull_s(self, inst: Instance) -> float:
        """A pull by `inst` started now: its region's source (the weight store's egress, or
        the cross-region link) is shared by every pull of that region under way (with
        peer-to-peer fan-out, the pullers serve each other: `TransferModel`). What it moves
        follows from what `inst` holds (`TransferModel.pull_parts`): the delta if it holds the
        version before; under LoRA the adapter if it holds any version, else the base first
        (a boot holds nothing: a whole version, or the base)."""
        remote, transfer = is_remote(inst), self.sc.transfer
        pulling = sum(
            1
            for i in self.instances.values()
            if (i.state == "pulling" or (i.fetching and i.state == "up")) and is_remote(i) == remote
        )
        holds_base = inst.version is not None
        holds_previous = holds_base and inst.version == self.clock.version - 1
        moves = []
        for payload, size in transfer.pull_parts(holds_previous, holds_base):
            route = self.route(remote, payload)
            moves.append(transfer.move_s(pulling, size, route))
            self.totals.pulled_bytes += size
            if route == "link":
                self.cross_region_bytes += transfer.link_bytes(size, self.carry(payload))
        seconds = sum(moves) + transfer.load_s
        self.totals.pulls += 1
        self.totals.pull_s += seconds
        self.totals.max_pull_s = max(self.totals.max_pull_s, seconds)
        return seconds

    def route(self, remote: bool, payload: Payload) -> Route:
        """Where a pull's `payload` comes from: the store, for an instance of its region; for a
        remote one the link, or with P2P its region's peers when one serves it already."""
        if not remote:
            return "store"
        if self.sc.transfer.p2p and self.region_holds(payload):
            return "peers"
        return "link"

    def carry(self, payload: Payload) -> bool:
        """A remote pull starts moving `payload` of the latest version over the link: whether
        it is the first to (the base: the first of the run, every version applies to it)."""
        version = 0 if payload == "base" else self.clock.version
        first = self.carried.get(payload, -1) < version
        self.carried[payload] = version
        return first

    def region_holds(self, payload: Payload) -> bool:
        """Whether an instance of the remote region serves `payload` already: the base, with
        any version; anything else, with the latest."""
        return any(
            is_remote(i)
            and i.state == "up"
            and (payload == "base" or i.version == self.clock.version)
            for i in self.instances.values()
        )

    def fetch(self, inst: Instance) -> None:
        """Asynchronous RL: pull the latest version in the background; the instance keeps
        generating its running requests with the weights it holds."""
        inst.fetching = True
        self.clock.at(
            self.clock.now + self.pull_s(inst), "fetched", (inst.name, self.clock.version)
        )

    def on_fetched(self, payload: tuple[str, int]) -> None:
        """The pull is loaded: the instance switches to it between two decode steps and its
        running requests continue under it (no drain, no restart)."""
        name, version = payload
        inst = self.instances[name]
        inst.fetching = False
        if inst.state != "up":
            return  # preempted (or told to go) meanwhile
        inst.version = version
        if version < self.clock.version:
            self.fetch(inst)  # a newer version was committed meanwhile

    def on_pulled(self, payload: tuple[str, int]) -> None:
        name, version = payload
        inst = self.instances[name]
        if inst.state != "pulling":
            return  # preempted while pulling
        inst.version = version
        if version >= self.clock.version:
            inst.state = "up"
        elif self.system.max_staleness:
            inst.state = "up"  # it may serve the steps its version is recent enough for
            self.fetch(inst)
        else:
            self.pull(inst)  # a newer version was committed meanwhile

    def preempt(self, inst: Instance) -> None:
        self.totals.preemptions += 1
        notice = self.sc.cloud.notice_s
        if notice > 0 and inst.state != "booting":
            self.requests.release(
                inst, len(inst.engine.running), "preemption"
            )  # flush, release, exit
            inst.state = "noticed"
            self.clock.at(self.clock.now + notice, "gone", inst.name)
            return
        held, items = [], []
        for rid in list(inst.engine.running):
            st = self.requests.step_of(rid)
            run, tokens = inst.engine.remove(rid)
            self.totals.generated += tokens
            flushed = tokens - tokens % self.sc.flush_tokens
            self.totals.lost_unflushed += tokens - flushed
            items.append((st, self.requests.delta(st, rid, run.lease, run.offset, flushed, False)))
            held.append((rid, run.lease))
        for st, step_items in self.requests.by_step(items):  # what it flushed before it died
            self.requests.collect(
                st,
                DeltaBatch(
                    worker_id=inst.name,
                    version=self.requests.held_version(inst, st),
                    items=step_items,
                ),
            )
        self.on_gone(inst.name)
        if held:
            self.clock.at(
                self.clock.now + self.sc.cloud.heartbeat_ttl_s, "detected", (inst.name, held)
            )

    def on_gone(self, name: str) -> None:
        inst = self.instances[name]
        inst.state, inst.gone_s = "gone", self.clock.now

    def on_detected(self, payload: tuple[str, list[tuple[str, int]]]) -> None:
        """A dead instance's heartbeat expired: the coordinator reclaims the jobs it held,
        (request, lease) each (`RequestFlow.reclaim`, through the step controller's
        `on_claimed`)."""
        name, held = payload
        self.requests.reclaim(name, held)

    def beats(self) -> dict[str, Heartbeat]:
        """The heartbeats the coordinator reads now: every registered instance's
        (`has_heartbeat`), on the run, with the weights it holds and whether it stepped aside.
        No plateau is told: the simulation balances by its engines' own (`RequestFlow`)."""
        return {
            i.name: Heartbeat(
                worker_id=i.name,
                pool=i.pool,
                run_id=RUN_ID,
                version=i.version,
                active=i.engine.batch,
                slots=i.engine.profile.max_seqs,
                tokens_generated=int(i.engine.tokens),
                at=self.clock.now,
                paused=i.paused,
            )
            for i in self.instances.values()
            if i.has_heartbeat
        }
