"""The subcommands that talk to a deployed coordinator over its API: submit, status, workers,
cancel, pause, resume and logs. Each takes the parsed arguments (with `--url`) and returns the
exit code; an API error or an unreachable coordinator is exit 1, an unreadable or invalid run
spec exit 2.
"""

import argparse
import json
import os
import sys

from services.cli.environment import TOKEN_VARIABLE
from services.contracts.runspec import RunSpec


def _client(args: argparse.Namespace):
    from services.cli.client import CoordinatorClient

    return CoordinatorClient(args.url, os.environ.get(TOKEN_VARIABLE))


def _api_call(fn) -> int:
    """Run one API interaction; an API error or an unreachable coordinator is exit 1."""
    import httpx

    from services.cli.client import CoordinatorError

    try:
        return fn()
    except CoordinatorError as exc:
        print(exc, file=sys.stderr)
    except httpx.HTTPError as exc:
        print(f"coordinator not reachable: {exc!r}", file=sys.stderr)
    return 1


def cmd_submit(args: argparse.Namespace) -> int:
    import tomllib

    from pydantic import ValidationError

    try:
        with open(args.spec, "rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        print(f"cannot read run spec {args.spec}: {exc}", file=sys.stderr)
        return 2
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        print(f"invalid run spec {args.spec}:\n{exc}", file=sys.stderr)
        return 2

    def submit() -> int:
        with _client(args) as client:
            run_id = client.submit(json.loads(spec.model_dump_json()))
            print(run_id)
            if args.follow:
                return _final_code(_follow(client, run_id))
        return 0

    return _api_call(submit)


def _follow(client, run_id: str) -> dict:
    from services.cli.follow import follow_run

    return follow_run(client, run_id)


def _final_code(run: dict) -> int:
    if run["state"] != "succeeded":
        print(f"run {run['id']} {run['state']}: {run['error']}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from services.cli.follow import out, runs_table

    def status() -> int:
        with _client(args) as client:
            if args.run is None:
                runs = client.runs()
                if args.json:
                    print(json.dumps(runs))
                else:
                    out.print(runs_table(runs, client.fleet()))
                return 0
            run = client.run(args.run) if args.json else _follow(client, args.run)
            print(json.dumps(run) if args.json else json.dumps(_brief(run)))
            return 0 if run["state"] != "failed" else 1

    return _api_call(status)


def _brief(run: dict) -> dict:
    keep = ("id", "state", "step", "steps", "reward_mean", "tokens_per_s", "t_seed_s", "error")
    health = ("health", "health_reason", "max_turns")  # failed calls of user code; episodes
    return {k: run[k] for k in keep} | {k: run.get(k) for k in health}


def cmd_workers(args: argparse.Namespace) -> int:
    from services.cli.follow import out, workers_table

    def workers() -> int:
        with _client(args) as client:
            listed = client.workers()
        if args.alive:
            listed = [w for w in listed if w["alive"]]
        if args.json:
            print(json.dumps(listed))
        else:
            out.print(workers_table(listed))
        return 0

    return _api_call(workers)


def cmd_cancel(args: argparse.Namespace) -> int:
    def cancel() -> int:
        with _client(args) as client:
            run = client.cancel(args.run)
        print(json.dumps(_brief(run)))
        return 0

    return _api_call(cancel)


def cmd_pause(args: argparse.Namespace) -> int:
    """`spotrl pause RUN` / `spotrl resume RUN` (args.order)."""

    def ordered() -> int:
        with _client(args) as client:
            run = client.order(args.run, args.order)
        print(json.dumps(_brief(run) | {"paused_at": run.get("paused_at")}))
        return 0

    return _api_call(ordered)


def cmd_logs(args: argparse.Namespace) -> int:
    from services.cli.follow import print_events

    def logs() -> int:
        with _client(args) as client:
            print_events(client, args.run, args.follow, out=lambda line: print(line, flush=True))
        return 0

    return _api_call(logs)
