"""`spotrl scale`: holds a preemptible rollout pool at the coordinator's `preemptible_wanted`.

Every `interval_s` it reads the figure from the coordinator's REST API (GET /v1/fleet: the
active runs and the pool they want; or the run given), reads the replicas the engine holds, asks
`scale_decision.decide` what to hold, and sets it on the engine (`scale_targets`: a Kubernetes
Deployment, a Swarm service, a Compose service), unless `dry_run`. One log line and one metric
per decision. It runs until SIGTERM or SIGINT, or for one decision with `once`. It is for
engines without their own autoscaler: where KEDA runs, the Helm chart scales on the
coordinator's gauges instead.

No run is a state, not an error: with no active run (or the run given has ended) the decision
is the pool's minimum ("down: no run", after the down cooldown); a run without a figure yet holds
(`when_unknown`).

Exit codes: 0 done or interrupted; 1 the coordinator is unreachable or answers an error; 2 bad
options (bounds); 3 the run given does not exist; 4 the deployment or service does not exist;
5 the engine refused or is unreachable. A failure on the first decision is fatal; later, a
coordinator that cannot be read counts as no figure (the pool is held, never shrunk) and an
engine error is fatal.

What other code calls (the multi-host Swarm test): `follow(ScaleSettings(...), stop)` in a
thread, `stop.set()` to end it; it returns the `Scaler`, whose `counts` and `history` say what
it decided.
"""

import argparse
import logging
import signal
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from services.cli.environment import TOKEN_VARIABLE
from services.cli.scale_decision import ScaleDecision, decide
from services.cli.scale_settings import ScaleSettings

if TYPE_CHECKING:
    from services.cli.client import CoordinatorClient
    from services.cli.scale_targets import ReplicaTarget

log = logging.getLogger(__name__)
HISTORY = 1000  # decisions a Scaler keeps for its caller (the newest)

EXIT_COORDINATOR, EXIT_USAGE, EXIT_NO_RUN, EXIT_MISSING, EXIT_ENGINE = 1, 2, 3, 4, 5


class NoRun(RuntimeError):
    """The run named (`--run`) does not exist."""


@dataclass(frozen=True)
class Figure:
    """What one read of the coordinator says."""

    runs: str  # the runs it is of, for the log line ("-": none)
    wanted: int | None  # the pool they want (None: no figure yet)
    run_active: bool  # False: no run (none active, or the run followed has ended)


NOT_READ = Figure("-", None, True)  # a coordinator that could not be read: hold what runs


def read_figure(client: "CoordinatorClient", run_id: str | None) -> Figure:
    """The deployment's figure (GET /v1/fleet: every active run), or that of the run named."""
    from services.cli.client import CoordinatorError
    from services.contracts.runspec import FINAL_STATES

    path = "/v1/fleet" if run_id is None else f"/v1/runs/{run_id}"
    resp = client.http.get(path)
    if resp.status_code == 404 and run_id is not None:
        raise NoRun(f"run {run_id} does not exist")
    if resp.status_code != 200:
        raise CoordinatorError(f"GET {path}: {resp.status_code} {resp.text}")
    body = resp.json()
    if run_id is None:
        active = body["active_runs"]
        return Figure(",".join(active) or "-", body["preemptible_wanted"] or None, bool(active))
    wanted = body.get("preemptible_wanted")
    ended = body["state"] in FINAL_STATES
    return Figure(run_id, int(wanted) if wanted is not None else None, not ended)


class Scaler:
    """The loop: read the figure, decide, apply; `counts` and `history` are for its caller."""

    def __init__(
        self,
        settings: ScaleSettings,
        client: "CoordinatorClient",
        target: "ReplicaTarget",
        clock=time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.client, self.target, self.clock = client, target, clock
        self.last_change_s: float | None = None
        self.counts: Counter[str] = Counter()
        self.history: deque[ScaleDecision] = deque(maxlen=HISTORY)

    @classmethod
    def build(cls, settings: ScaleSettings, token: str | None = None) -> "Scaler":
        """With a coordinator client (`token` for protected reads) and the settings' target."""
        from services.cli.client import CoordinatorClient

        return cls(settings, CoordinatorClient(settings.url, token), settings.build_target())

    def _figure(self) -> Figure:
        import httpx

        from services.cli.client import CoordinatorError

        try:
            return read_figure(self.client, self.settings.run_id)
        except (NoRun, CoordinatorError, httpx.HTTPError) as exc:
            if not self.history:
                raise
            log.warning("no figure this time: %s", exc)
            return NOT_READ

    def tick(self) -> ScaleDecision:
        """One decision, carried out unless dry_run."""
        from services.cli.scale_metrics import record

        began = self.clock()
        figure = self._figure()
        engine_at = self.clock()
        read_s = engine_at - began
        current = self.target.replicas()
        decision = decide(
            self.policy,
            figure.wanted,
            current,
            self.last_change_s,
            self.clock(),
            figure.run_active,
        )
        if decision.changes and not self.settings.dry_run:
            self.target.set_replicas(decision.target)
            self.last_change_s = self.clock()
        engine_s = self.clock() - engine_at
        self.counts[decision.reason] += 1
        self.history.append(decision)
        record(decision)
        log.info(
            "scale %s run=%s wanted=%s current=%d target=%d reason=%r%s%s read_ms=%.0f "
            "engine_ms=%.0f",
            self.target.description,
            figure.runs,
            figure.wanted,
            decision.current,
            decision.target,
            decision.reason,
            f" cooldown_left_s={decision.cooldown_left_s:.1f}" if decision.cooldown_left_s else "",
            " dry_run" if self.settings.dry_run and decision.changes else "",
            read_s * 1e3,
            engine_s * 1e3,
        )
        return decision

    def run(self, stop: threading.Event) -> None:
        """Decide every interval_s until `stop` is set (one decision with `once`)."""
        while not stop.is_set():
            began = self.clock()
            self.tick()
            if self.settings.once:
                return
            stop.wait(max(0.0, self.settings.interval_s - (self.clock() - began)))

    def close(self) -> None:
        self.client.close()


def follow(settings: ScaleSettings, stop: threading.Event, token: str | None = None) -> Scaler:
    """Build a Scaler and run it until `stop` is set (or for one decision with `once`); returns
    it, for its `counts` and `history`. Errors are raised as `cmd_scale` maps them."""
    scaler = Scaler.build(settings, token)
    try:
        scaler.run(stop)
    finally:
        scaler.close()
    return scaler


def settings_from_args(args: argparse.Namespace) -> ScaleSettings:
    cooldowns = {
        "up_cooldown_s": args.up_cooldown if args.up_cooldown is not None else args.cooldown,
        "down_cooldown_s": args.down_cooldown if args.down_cooldown is not None else args.cooldown,
    }
    return ScaleSettings(
        url=args.url,
        run_id=args.run,
        target=args.target,
        min_replicas=args.min,
        max_replicas=args.max,
        interval_s=args.interval,
        when_unknown=args.when_unknown,
        dry_run=args.dry_run,
        once=args.once,
        metrics_port=args.metrics_port,
        namespace=args.namespace,
        deployment=args.deployment,
        kubeconfig=args.kubeconfig,
        context=args.context,
        service=args.service,
        compose_project=args.project,
        compose_files=args.file,
        **{k: v for k, v in cooldowns.items() if v is not None},  # None: the default
    )


def one_line(exc: ValidationError) -> str:
    """A validation error as one line: `field: message; ...` (the input is never shown)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where + ': ' if where else ''}{error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def cmd_scale(args: argparse.Namespace) -> int:
    import os

    import httpx

    from services.cli.client import CoordinatorError
    from services.cli.scale_metrics import serve
    from services.cli.scale_targets import ScaleTargetError, ScaleTargetMissing

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"spotrl scale: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)  # the decision lines are this command's output
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = None
    try:
        if settings.metrics_port is not None:
            try:
                server = serve(settings.metrics_port)
            except OSError as exc:
                port = settings.metrics_port
                print(f"spotrl scale: metrics on 127.0.0.1:{port}: {exc}", file=sys.stderr)
                return EXIT_USAGE
        follow(settings, stop, os.environ.get(TOKEN_VARIABLE))
    except NoRun as exc:
        print(f"spotrl scale: {exc}", file=sys.stderr)
        return EXIT_NO_RUN
    except CoordinatorError as exc:
        print(f"spotrl scale: coordinator: {exc}", file=sys.stderr)
        return EXIT_COORDINATOR
    except httpx.HTTPError as exc:
        print(f"spotrl scale: coordinator not reachable at {settings.url}: {exc}", file=sys.stderr)
        return EXIT_COORDINATOR
    except ScaleTargetMissing as exc:
        print(f"spotrl scale: {exc}", file=sys.stderr)
        return EXIT_MISSING
    except ScaleTargetError as exc:
        print(f"spotrl scale: {exc}", file=sys.stderr)
        return EXIT_ENGINE
    finally:
        if server is not None:
            server.shutdown()
    return 0
