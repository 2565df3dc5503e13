"""Following a run from a terminal: a live progress bar, tables of runs and workers, and the
run's event log. Used by `spotrl status/workers/logs` and by `spotrl up`."""

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.cli.client import CoordinatorClient
from services.contracts.runspec import FINAL_STATES

console = Console(stderr=True)  # progress goes to stderr; results to stdout
# tables on stdout, not cut to 80 columns when piped
out = Console(width=None if sys.stdout.isatty() else 200)


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


STALL_REASON_CHARS = 60  # in the progress bar; the whole reason is printed once above it


def progress_info(run: dict, alive_workers: int, note: str = "") -> str:
    state = run["state"]
    if state == "stalled":
        reason = run.get("stall_reason") or "?"
        state = f"stalled ({reason[:STALL_REASON_CHARS]})"
    text = (
        f"{state}  reward {_num(run['reward_mean'], 3)}  "
        f"tok/s {_num(run['tokens_per_s'], 0)}  workers {alive_workers}"
    )
    failing = error_note(run)
    text = f"{text}  {failing}" if failing else text
    return f"{text}  {note}" if note else text


def error_note(run: dict) -> str:
    """The run's failed calls of user code, by kind, with their share ("" when none failed):
    `env errors 12/96 (12.5%)  reward errors 3/48 (6.2%)`."""
    short = {"environment": "env", "reward": "reward"}
    parts = [
        f"{short.get(kind, kind)} errors {c['failed']}/{c['calls']} ({100 * c['share']:.1f}%)"
        for kind, c in (run.get("errors") or {}).items()
        if c.get("failed")
    ]
    return "  ".join(parts)


def state_change_line(before: dict | None, run: dict) -> str | None:
    """What to print when a run becomes stalled or goes on again (None: nothing to say)."""
    was = before["state"] if before else None
    if run["state"] == "stalled" and (
        was != "stalled" or (before or {}).get("stall_reason") != run.get("stall_reason")
    ):
        return f"run {run['id']} stalled: {run.get('stall_reason') or '?'}"
    if was == "stalled" and run["state"] == "running":
        return f"run {run['id']} running again"
    return None


def progress_bar(title: str) -> Progress:
    """A bar with a description, done/total, a free `info` field and the elapsed time."""
    console.print(f"[bold]{title}[/bold]")
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )


def follow_run(
    client: CoordinatorClient,
    run_id: str,
    check: Callable[[dict], None] | None = None,
    poll_s: float = 0.5,
    note: Callable[[], str] | None = None,
) -> dict:
    """Show a progress bar of the run's steps until it reaches a final state; return the run.
    `check(run)` is called on every poll and may raise to stop following; `note()` adds text to
    the bar. A stalled run's reason is printed when it stalls, and its return when it goes on."""
    with progress_bar(f"run {run_id}") as bar:
        run, before = client.run(run_id), None
        task_id = bar.add_task("RL steps", total=run["steps"], info=run["state"])
        while True:
            change = state_change_line(before, run)
            if change:
                bar.console.print(change, markup=False, highlight=False, soft_wrap=True)
            alive = sum(w["alive"] for w in client.workers())
            info = progress_info(run, alive, note() if note else "")
            bar.update(task_id, completed=run["step"], info=info)
            if run["state"] in FINAL_STATES:
                return run
            if check is not None:
                check(run)
            time.sleep(poll_s)
            run, before = client.run(run_id), run


def runs_table(runs: list[dict], fleet: dict | None = None) -> Table:
    """The runs, and for each active one its share of the fleet and the workers serving it
    (`fleet`: GET /v1/fleet)."""
    on_fleet = {run["id"]: run for run in (fleet or {}).get("runs", [])}
    table = Table(
        "run", "state", "step", "reward", "tok/s", "T_seed (s)", "share", "workers", "error"
    )
    for run in runs:
        share = on_fleet.get(run["id"])
        table.add_row(
            run["id"],
            run["state"] + (" (paused)" if run.get("paused_at") else ""),
            f"{run['step']}/{run['steps']}",
            _num(run["reward_mean"], 3),
            _num(run["tokens_per_s"], 0),
            _num(run["t_seed_s"], 2),
            "-" if share is None else _num(share["share"], 1),
            "-" if share is None else f"{share['workers']} ({share['active']}/{share['slots']})",
            (run["error"] or run.get("stall_reason") or "")[:60],
        )
    return table


def workers_table(workers: list[dict]) -> Table:
    table = Table(
        "worker",
        "pool",
        "engine",
        "alive",
        "run",
        "version",
        "active/slots",
        "tokens",
        "last error",
    )
    for w in workers:
        table.add_row(
            w["id"],
            w["pool"],
            w["engine"],
            "yes" if w["alive"] else "no",
            ",".join(w.get("runs") or {}) or w["run_id"] or "-",  # every run it serves
            "-" if w["version"] is None else str(w["version"]),
            f"{w['active']}/{w['slots']}",
            str(w["tokens_generated"]),
            (w.get("last_error") or "")[:60],
        )
    return table


def event_line(event: dict) -> str:
    """One line of `spotrl logs`: local time, kind, then the details as key=value."""
    when = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    details = []
    for key, value in event.items():
        if key in ("id", "at", "kind"):
            continue
        details.append(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")
    return f"{when}  {event['kind']:<16} {' '.join(details)}".rstrip()


def print_events(
    client: CoordinatorClient, run_id: str, follow: bool, poll_s: float = 1.0, out=print
) -> dict:
    """Print the run's events; with `follow`, keep printing new ones until the run is final."""
    after = None
    while True:
        run = client.run(run_id)  # before reading: a final run's last events are then in
        events = client.timeline(run_id, after_event=after)["events"]
        for event in events:
            out(event_line(event))
        if events:
            after = events[-1]["id"]
        if not follow or run["state"] in FINAL_STATES:
            return run
        time.sleep(poll_s)
