"""spotrl across three Swarm nodes (tests/swarm/cluster.py): one reserved node (Redis, the
coordinator, the weight store, the trainer), two spot nodes (rollout), every node a dockerd in a
network namespace of the test's own. The images are loaded from a tarball (no registry), the
stack is docker-compose.yml rendered for Swarm (tools/swarm_stack.py), and the test's clients
reach it from a client namespace on the same subnet (never through the host's interfaces).

The run, submitted over the REST API with the token: workers on both spot nodes produce tokens
and pull weight blocks from each other; `spotrl scale` (its Scaler) holds the rollout service at
`preemptible_wanted` within bounds. spot2 is cut off from the network (its bridge port down)
while a worker there holds requests, until the coordinator declared the worker dead and its
requests generate elsewhere, then put back: what the worker generated meanwhile arrives under
leases that moved on and is fenced (counted), and it reads jobs again. Later spot1 is drained
mid-step (the notice: SIGTERM and the stop grace period), then a rollout container on spot2 is
killed (no notice). The time until what each held generates again elsewhere is measured
(services/cli/recovery.py). The run must end exact (audit: nothing lost or duplicated) and
learn; teardown must leave nothing.

`python -m tests.swarm.scenario` prints the summary as JSON, last line; tests/swarm/test_swarm.py
asserts it.
"""

import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.recovery import RecoveryWatch, held_requests
from services.cli.redis_client import open_redis
from services.cli.scale import Scaler, ScaleSettings
from services.contracts import keys
from services.contracts.runspec import RunSpec
from tests.harness.models import copy_model
from tests.integration.conftest import wait_until
from tests.swarm.cluster import Cluster, running_cluster
from tests.swarm.images import build_and_save, load_everywhere, say
from tests.swarm.stack import SwarmStack

MODEL = "/models/arithmetic-base"
KEYS = ("nodes", "workers_max", "blocks_from_peers", "partitioned", "fenced_late_deltas",
        "drained", "killed", "lost", "duplicated", "reward_first", "reward_last",
        "recovery_partition_s", "recovery_notice_s", "recovery_kill_s", "rejoined_s",
        "notice_delay_s", "recovery_from_drain_s",
        "scale_decisions", "leftovers", "wall_s")  # fmt: skip
FINAL = {"succeeded", "failed", "cancelled"}
STEPS = int(os.environ.get("SPOTRL_SWARM_STEPS", "40"))
BLOCK_BYTES = 64 * 1024  # the smallest blocks: a version is many, some from a peer
PARTITION_AT_STEP = 3  # spot2 cut off from the network from this step
PARTITION_S = 8.0  # at least; longer than the heartbeat TTL (5 s), and until its requests moved
DRAIN_AT_STEP = 10  # the versions before it are pulled by workers on both spot nodes
SETTINGS = {
    "SPOTRL_TRAINER_THREADS": "1",
    "SPOTRL_ROLLOUT_THREADS": "1",
    "SPOTRL_ROLLOUT_REPLICAS": "2",
    "SPOTRL_BLOCK_BYTES": str(BLOCK_BYTES),
    "SPOTRL_PREEMPT_GRACE_S": "20",
    "SPOTRL_STOP_GRACE": "30s",
    # a slower engine: a response lasts longer than the drain takes to reach the worker, so
    # the drained worker still holds requests at its notice
    "SPOTRL_STEP_DELAY_MS": "150",
    # 16 requests at once a worker: a step's rollout takes several rounds of ~1 s, so a worker
    # drained at a step's start still generates when Swarm's SIGTERM reaches it, 2-3 s later
    "SPOTRL_SLOTS": "16",
    # the store's egress capped (16 Mbit/s: a version takes ~1.4 s from it alone), so a worker
    # takes the blocks another already holds from it, across nodes, rather than all from the
    # store: without a cap both often pull everything from the store at once
    "SPOTRL_STORE_EGRESS_MBPS": "16",
}
SCALE_BOUNDS = (2, 3)  # replicas `spotrl scale` may hold: never below one per spot node


class Driver:
    """The run and its events, from the client namespace."""

    def __init__(self, cluster: Cluster, stack: SwarmStack, summary: dict) -> None:
        self.cluster, self.stack, self.summary = cluster, stack, summary
        self.client = CoordinatorClient(stack.coordinator_url, stack.token, ca_file=stack.ca_file)
        self.r = open_redis(stack.redis_url, stack.ca_file)  # the read-only user, over TLS
        self.run_id = ""
        self.workers: dict[str, str] = {}  # container -> the worker id it registered
        self.refused_at_cut = 0  # late delta items the coordinator had refused at the partition
        summary["workers_max"] = 0

    def producing(self) -> list[dict]:
        """Alive preemptible workers of the run that produced tokens (and note the most)."""
        ws = [
            w
            for w in self.client.workers()
            if w.get("alive") and w.get("run_id") == self.run_id and w["pool"] == "preemptible"
            and w["tokens_generated"] > 0
        ]  # fmt: skip
        self.summary["workers_max"] = max(self.summary["workers_max"], len(ws))
        return ws

    def ended(self) -> dict | None:
        """The run once it is over (and the workers producing, counted on the way)."""
        self.producing()
        run = self.client.run(self.run_id)
        return run if run["state"] in FINAL else None

    def step(self) -> int:
        run = self.client.run(self.run_id)
        return run["step"] if run["state"] not in FINAL else 1 << 30

    def holding(self, node: str) -> tuple[str, str, dict[str, int]] | None:
        """(container, worker id, requests held) of a rollout container on `node` that holds
        requests of the steps in flight (its pending jobs), most of them still generating."""
        n = self.cluster.nodes[node]
        for cid in self.stack.containers(n, "rollout"):
            worker = self.workers.get(cid) or self.stack.worker_of(n, cid)
            if worker:
                self.workers[cid] = worker
            held = held_requests(self.r, self.run_id, worker) if worker else {}
            if worker and held and self.generating(worker, held) >= max(1, len(held) // 2):
                return cid, worker, held
        return None

    def generating(self, worker: str, held: dict[str, int]) -> int:
        """How many of the requests `worker` holds have not finished yet."""
        probe = RecoveryWatch(self.r, self.run_id, worker, "probe", held, time.time())
        probe.poll()
        return sum(1 for q in probe.tracker.requests.values() if not q.finished)

    def recovery(self, watch: RecoveryWatch, timeout_s: float) -> float | None:
        """Until what the watch follows generates again elsewhere: seconds from the loss (None:
        nothing it held moved, or something did not generate again within `timeout_s`)."""
        got = watch.wait(timeout_s=timeout_s, poll_s=0.05)
        say(f"recovery ({watch.cause}): {got.summary()}")
        self.summary.setdefault("recovery", {})[watch.cause] = got.summary()
        return None if got.recovery_s is None or not got.held else round(got.recovery_s, 2)

    def run(self, spec: dict) -> None:
        self.run_id = self.client.submit(spec)
        wait_until(lambda: self.step() >= 1, "the first step", 300, poll_s=0.5)
        nodes = wait_until(
            lambda: (
                n
                if (n := {w["id"].split("-")[0] for w in self.producing()}) >= {"spot1", "spot2"}
                else None
            ),
            "workers on both spot nodes producing tokens",
            300,
            poll_s=0.5,
        )
        say(f"workers producing on both spot nodes at step {self.step()} ({nodes})")
        self.partition("spot2")
        wait_until(lambda: self.step() >= DRAIN_AT_STEP, f"step {DRAIN_AT_STEP}", 300, poll_s=0.2)
        self.summary["peer_loads_before_drain"] = self.stack.peer_loads()

        scaler = self.start_scaler()
        try:
            self.drain("spot1")
            self.kill("spot2")
            run = wait_until(
                self.ended,
                "the run's end",
                900,
                poll_s=1.0,
            )
        finally:
            scaler_stop, scaler_thread, the_scaler = scaler
            scaler_stop.set()
            scaler_thread.join(30)
            self.summary["scale_decisions"] = len(the_scaler.history)
            self.summary["scale_changes"] = [
                {"wanted": d.wanted, "from": d.current, "to": d.target}
                for d in the_scaler.history
                if d.changes
            ]
            the_scaler.close()
            os.environ.pop("DOCKER_HOST", None)
            os.environ.pop("SPOTRL_TLS_CA_FILE", None)
        self.finish(run, spec)

    def start_scaler(self):
        settings = ScaleSettings(
            url=self.stack.coordinator_url,
            run_id=self.run_id,
            target="swarm",
            service="spotrl_rollout",
            min_replicas=SCALE_BOUNDS[0],
            max_replicas=SCALE_BOUNDS[1],
            interval_s=5,
            up_cooldown_s=10,
            down_cooldown_s=30,
        )
        os.environ["DOCKER_HOST"] = self.cluster.manager.host  # the Swarm target's manager
        os.environ["SPOTRL_TLS_CA_FILE"] = str(self.stack.ca_file)  # the Scaler's client checks
        scaler = Scaler.build(settings, self.stack.token)
        stop = threading.Event()
        thread = threading.Thread(target=scaler.run, args=(stop,), name="scale", daemon=True)
        thread.start()  # in this thread's namespace: the client one
        return stop, thread, scaler

    def partition(self, node: str) -> None:
        """A spot node cut off from the network while a worker there holds requests, for longer
        than the heartbeat TTL, then back: the coordinator declares the worker dead and its
        requests generate elsewhere; what it generated meanwhile arrives late, under leases
        that moved on (fenced: the steps' `stale_deltas`); it reads jobs again."""
        wait_until(lambda: self.step() >= PARTITION_AT_STEP, "the partition's step", 300)
        _, worker, held = wait_until(
            lambda: self.holding(node), f"a worker on {node} holding requests", 180, poll_s=0.05
        )
        self.refused_at_cut = self.refused_late()
        at_step, at = self.step(), time.time()
        self.cluster.fabric.cut(node)
        try:
            held |= held_requests(self.r, self.run_id, worker)  # acknowledged by nobody now
            say(f"cut {node} off at step {at_step}: {worker} held {len(held)} requests")
            watch = RecoveryWatch(self.r, self.run_id, worker, "partition", held, at)
            # cut off until its requests generate elsewhere: it was declared dead (heartbeat TTL)
            self.summary["recovery_partition_s"] = self.recovery(watch, 60)
            wait_until(lambda: time.time() - at >= PARTITION_S, "the partition's length", 60)
        finally:
            self.cluster.fabric.mend(node)
        back = time.time()
        self.summary["partitioned"], self.summary["partition_s"] = 1, round(back - at, 1)
        wait_until(  # a job read since it is back: its old ones were claimed from it
            lambda: set(held_requests(self.r, self.run_id, worker)) - set(held),
            f"{worker} reading jobs again",
            180,
            poll_s=0.1,
        )
        self.summary["rejoined_s"] = round(time.time() - back, 1)
        say(f"{node} back after {self.summary['partition_s']} s: {worker} reads jobs again")

    def refused_late(self) -> int:
        """Delta items the coordinator refused as late so far: under a lease that moved on, or
        of a step no longer in flight (its /metrics, `spotrl_coordinator_delta_items_total`)."""
        families = text_string_to_metric_families(self.client.prometheus())
        return int(
            sum(
                sample.value
                for family in families
                if family.name == "spotrl_coordinator_delta_items"
                for sample in family.samples
                if sample.labels.get("outcome") in ("stale_lease", "unknown")
            )
        )

    def fenced_since_the_partition(self) -> None:
        """What the partitioned worker sent late and the coordinator refused (between the cut
        and now), and the requests it dropped when its orders said they had moved (it read
        them before its flush went out: then nothing of them arrives late)."""
        self.summary["fenced_late_deltas"] = self.refused_late() - self.refused_at_cut
        self.summary["fenced_by_order"] = sum(
            1
            for line in self.stack.service_logs("rollout")
            if "@spot2" in line and "it was migrated" in line
        )

    def drain(self, node: str) -> None:
        """Spot node lost with notice: Swarm stops its tasks, SIGTERM then the grace period.
        Drained as a step starts (Swarm's SIGTERM comes 2-3 s later: the worker must still be
        generating then for the notice to move anything). The watch starts at the drain: the
        worker reads jobs until the SIGTERM reaches it, and what it holds then is followed as
        it is seen (`follow_until_it_leaves`)."""
        self.fenced_since_the_partition()  # before the drain and the kill add their own
        before = self.step()
        wait_until(lambda: self.step() > before, "a step's start", 300, poll_s=0.05)
        _, worker, held = wait_until(
            lambda: self.holding(node), f"a worker on {node} holding requests", 180, poll_s=0.05
        )
        at_step, at = self.step(), time.time()
        watch = RecoveryWatch(self.r, self.run_id, worker, "notice", held, at)
        self.cluster.manager.docker("node", "update", "--availability", "drain", node)
        noticed_at = self.follow_until_it_leaves(watch)
        # Swarm's part: from the drain to the worker's notice (its SIGTERM)
        delay = self.summary["notice_delay_s"] = round(noticed_at - at, 2)
        self.summary["drained"] = 1
        say(f"drained {node} at step {at_step}: {worker} noticed after {delay} s")
        # measured, not checked here: a watch that misses a resolution must not use up the run
        # that the kill after it needs (CI: a 180 s wait outlived the run, the kill found no one)
        from_drain = self.summary["recovery_from_drain_s"] = self.recovery(watch, 30)
        # from the notice the worker got, as for a cloud's notice, which reaches it directly
        self.summary["recovery_notice_s"] = (
            None if from_drain is None else round(from_drain - delay, 2)
        )
        wait_until(lambda: self.step() >= at_step + 2, "steps after the drain", 300, poll_s=0.5)

    def follow_until_it_leaves(self, watch: RecoveryWatch, timeout_s: float = 60.0) -> float:
        """Poll `watch` and add what its worker holds until the worker says it left (its
        release acknowledges what it held); when the notice reached it (unix seconds)."""
        leaving = keys.worker_leaving(watch.worker_id)
        deadline = time.monotonic() + timeout_s
        while (noticed_at := self.r.get(leaving)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{watch.worker_id} did not leave {timeout_s} s after a notice")
            watch.hold(held_requests(self.r, self.run_id, watch.worker_id))
            watch.poll()
            time.sleep(0.01)
        return float(noticed_at)

    def kill(self, node: str) -> None:
        """A rollout container lost without notice: SIGKILL."""
        cid, worker, held = wait_until(
            lambda: self.holding(node), f"a worker on {node} holding requests", 180, poll_s=0.05
        )
        at_step, at = self.step(), time.time()
        self.cluster.nodes[node].docker("kill", cid)
        held |= held_requests(self.r, self.run_id, worker)  # frozen by the SIGKILL
        self.summary["killed"] = 1
        say(f"killed {worker} on {node} at step {at_step}: it held {len(held)} requests")
        watch = RecoveryWatch(self.r, self.run_id, worker, "kill", held, at)
        self.summary["recovery_kill_s"] = self.recovery(watch, 180)
        wait_until(lambda: self.step() >= at_step + 2, "steps after the kill", 300, poll_s=0.5)

    def finish(self, run: dict, spec: dict) -> None:
        s = self.summary
        s["state"], s["steps"] = run["state"], run["step"]
        rows = self.client.metrics(self.run_id)
        rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
        k = min(5, len(rewards) // 2) or 1
        s["reward_first"] = round(sum(rewards[:k]) / k, 3) if rewards else None
        s["reward_last"] = round(sum(rewards[-k:]) / k, 3) if rewards else None
        spec_model = RunSpec.model_validate(spec)
        audit = audit_run(
            self.stack.redis_url, self.run_id, spec_model, run["step"], self.stack.ca_file
        )
        s["lost"], s["duplicated"] = audit["lost"], audit["duplicated"]

    def close(self) -> None:
        self.client.close()
        self.r.close()


def blocks_from_peers(loads: list[tuple[str, int, int, int]]) -> int:
    """Blocks pulled from a peer, as counted from each load's bytes from peers."""
    return sum(math.ceil(from_peers / BLOCK_BYTES) for _, _, _, from_peers in loads)


# the base model: "embedded" (the Compose test's too: built once, tests/harness/models.py) or
# "tiny" (seconds to build, learns less)
MODEL_SIZE = os.environ.get("SPOTRL_SWARM_MODEL", "embedded")


def drive(cluster: Cluster, work: Path, summary: dict, steps: int) -> None:
    stack = SwarmStack(cluster, work, SETTINGS)
    copy_model(MODEL_SIZE, stack.models / Path(MODEL).name)
    t_up = time.monotonic()
    stack.deploy()
    try:
        stack.wait_healthy(420)
        summary["up_healthy_s"] = round(time.monotonic() - t_up, 1)
        say(f"stack healthy after {summary['up_healthy_s']} s")
        spec = {"model": MODEL, "task": "arithmetic", "steps": steps,
                "prompts_per_step": 32, "group_size": 8, "seed": 0}  # fmt: skip
        with cluster.client_netns():
            driver = Driver(cluster, stack, summary)
            try:
                driver.run(spec)
            finally:
                driver.close()
        before = summary.pop("peer_loads_before_drain")
        summary["blocks_from_peers"] = blocks_from_peers(before)
        summary["peer_loads"] = len([x for x in before if x[3] > 0])
    except BaseException:
        for service in ("redis", "weightstore", "coordinator", "trainer", "rollout"):
            tail = "\n".join(stack.service_logs(service)[-15:])
            say(f"{service}, last lines:\n{tail}")
        raise
    finally:
        summary["registry_lookups"] = stack.registry_lookups()
        summary["stack_left"] = stack.remove()


def run_scenario(work: Path, steps: int = STEPS) -> dict:
    summary: dict = {"nodes": 0}
    t0 = time.monotonic()
    tarball, ids, build_s = build_and_save()
    summary["build_s"] = round(build_s, 1)
    with running_cluster() as cluster:
        summary["nodes"] = len(cluster.ready_nodes())
        t_load = time.monotonic()
        summary["loaded_into"] = load_everywhere(cluster, tarball, ids)
        summary["load_s"] = round(time.monotonic() - t_load, 1)
        say(f"images on every node ({summary['load_s']} s; loaded into {summary['loaded_into']})")
        drive(cluster, work, summary, steps)
    summary["leftovers"] = cluster.leftovers()
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    return {k: summary.get(k) for k in KEYS} | summary  # the keys first


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="spotrl-swarm-") as tmp:
        print(json.dumps(run_scenario(Path(tmp), int(sys.argv[1]) if len(sys.argv) > 1 else STEPS)))
