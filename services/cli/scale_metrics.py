"""The metrics of `spotrl scale`, one update per decision, and the loopback server that serves
them (`--metrics-port`). The metrics live in the process's default registry, once per process."""

from prometheus_client import Counter, Gauge, start_http_server

from services.cli.scale_decision import REASONS, ScaleDecision

DECISIONS = Counter("spotrl_scale_decisions", "Scaling decisions, by reason", ["reason"])
TARGET = Gauge("spotrl_scale_target_replicas", "Replicas the newest decision holds")
CURRENT = Gauge("spotrl_scale_current_replicas", "Replicas the engine held at the newest decision")
WANTED = Gauge(
    "spotrl_scale_wanted_replicas", "The coordinator's preemptible_wanted as read (-1: no figure)"
)
for _reason in REASONS:
    DECISIONS.labels(_reason)  # every reason exported from the start, at 0


def record(decision: ScaleDecision) -> None:
    DECISIONS.labels(decision.reason).inc()
    TARGET.set(decision.target)
    CURRENT.set(decision.current)
    WANTED.set(-1 if decision.wanted is None else decision.wanted)


def serve(port: int):
    """Serve /metrics on 127.0.0.1:`port` from a daemon thread; returns the server (its
    `server_port` is the port bound, `shutdown()` stops it)."""
    server, _thread = start_http_server(port, addr="127.0.0.1")
    return server
