"""The JSON summary `spotrl up` prints as its last line: of a run that reached a final state
(its metrics, plot and audit), or of an invocation stopped before (why)."""

import json
import time
from pathlib import Path

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.follow import console
from services.cli.local_deployment import LocalDeployment
from services.cli.plots import plot_run
from services.cli.procs import ProcessDied
from services.cli.supervisor import error_headline
from services.contracts.runspec import RunSpec


def migration_totals(rows: list[dict]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in rows:
        for cause, n in (row.get("migrations") or {}).items():
            totals[cause] = totals.get(cause, 0) + n
    return totals


def rounded(value: float | None, digits: int) -> float | None:
    """A figure as the summary prints it: `digits` decimals (never 0.3976562500000006)."""
    return None if value is None else round(value, digits)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run: dict, rows: list[dict], wall_s: float) -> dict:
    """The figures of a run: rewards to 4 decimals, seconds to 2, rates to 1; `health` and
    `errors` say how the run's user code (environment, reward) failed (`core.call_errors`)."""
    rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
    tps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    step_s = [row["step_s"] for row in rows if "step_s" in row]
    rollout_s = [row["rollout_s"] for row in rows if "rollout_s" in row]
    lengths = [row["response_len_mean"] for row in rows if "response_len_mean" in row]
    return {
        "run_id": run["id"],
        "state": run["state"],
        "health": run.get("health", "ok"),
        "steps": run["step"],
        "reward_first": rounded(rewards[0] if rewards else None, 4),
        "reward_last": rounded(rewards[-1] if rewards else None, 4),
        # whether the run learned, less noisy than one step against another
        "reward_first10_mean": rounded(mean(rewards[:10]), 4),
        "reward_last10_mean": rounded(mean(rewards[-10:]), 4),
        "groups_incomplete": run["groups_incomplete"],
        "reward_errors": sum(row.get("reward_errors") or 0 for row in rows),
        "errors": run.get("errors") or {},
        "tokens_per_s_mean": rounded(mean(tps), 1),  # rollout windows only
        "step_s_mean": rounded(mean(step_s), 2),  # whole steps
        "rollout_s_mean": rounded(mean(rollout_s), 2),  # a step's first job to its last token
        "response_len_mean": rounded(mean(lengths), 1),  # tokens, over the steps' means
        "migrations": migration_totals(rows),
        "t_seed_s_last": rounded(
            next((r["t_seed_s"] for r in reversed(rows) if r.get("t_seed_s") is not None), None),
            2,
        ),
        "n_prem_recommended": rounded(run.get("n_prem_recommended"), 2),
        "preemptible_wanted": run.get("preemptible_wanted"),
        "wall_s": round(wall_s, 1),
    }


def died_reason(exc: ProcessDied) -> str:
    """One line for the summary: who exited with what, and its error line."""
    first, _, log_text = str(exc).partition("\n")
    headline = error_headline(log_text)
    return f"{first.rstrip(':')}: {headline}" if headline else first.rstrip(":")


def aborted_summary(exc: Exception, run: dict, wall_s: float) -> dict:
    """The summary of an invocation stopped before the run reached a final state."""
    return {
        "run_id": run["id"],
        "state": "aborted",
        "run_state": run["state"],
        "error": died_reason(exc) if isinstance(exc, ProcessDied) else str(exc),
        "stall_reason": run.get("stall_reason") or "",
        "steps": run["step"],
        "wall_s": round(wall_s, 1),
    }


def finished_summary(
    client: CoordinatorClient,
    deployment: LocalDeployment,
    run: dict,
    spec: RunSpec,
    run_dir: Path,
    started: float,
) -> dict:
    """The summary of a run that reached a final state, with its metrics, plot and audit."""
    if run["state"] != "succeeded":
        message = f"run {run['id']} {run['state']}: {run['error']}"
        console.print(message, style="bold red", markup=False, soft_wrap=True)
    elif run.get("health") == "degraded":
        message = f"run {run['id']} succeeded, degraded: {run.get('health_reason', '')}"
        console.print(message, style="bold yellow", markup=False, soft_wrap=True)
    rows = client.metrics(run["id"])
    (run_dir / "metrics.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(run, rows, time.monotonic() - started)
    summary["error"] = run.get("error") or ""
    summary["stall_reason"] = run.get("stall_reason") or ""
    summary["metrics_file"] = str(run_dir / "metrics.json")
    summary["plot"] = str(plot_run(rows, run_dir / "metrics.png", f"spotrl run {run['id']}"))
    audit = audit_run(
        deployment.reader_redis_url, run["id"], spec, steps=run["step"], ca_file=deployment.ca_file
    )
    return summary | {"lost": audit["lost"], "duplicated": audit["duplicated"]}
