"""The `spotrl` command line."""

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import get_args

from services.cli.spec_flags import add_spec_flags
from services.common.runspec import EMBEDDED_PRETRAIN_STEPS, RunSpec
from services.common.settings import CommonSettings, env_name
from services.rollout.settings import RolloutSettings

DEFAULT_HOME = Path(os.environ.get("SPOTRL_HOME", ".spotrl"))
TOKEN_VARIABLE = env_name(CommonSettings, "api_token")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _cmd_up(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from services.cli.spec_flags import describe_errors, spec_from_args
    from services.cli.up import up

    if args.weightstores < 1:
        print("spotrl up needs at least one weight store (--weightstores)", file=sys.stderr)
        return 2
    if args.reserved < 0 or args.preemptible < 0 or args.reserved + args.preemptible < 1:
        print(
            "spotrl up needs at least one rollout worker (--reserved/--preemptible)",
            file=sys.stderr,
        )
        return 2
    if args.engine == "vllm":
        from services.rollout.engines.vllm import VLLMUnavailable, import_vllm

        try:
            import_vllm()  # fail now, with the install command, rather than in every worker
        except VLLMUnavailable as exc:
            print(f"spotrl up --engine vllm: {exc}", file=sys.stderr)
            return 2
    if args.port is not None and not 1 <= args.port <= 65535:
        print(f"--port {args.port}: a TCP port is 1..65535", file=sys.stderr)
        return 2
    if args.port is not None and not _port_free(args.port):
        # else another service on it could answer for our coordinator
        print(f"--port {args.port}: in use on 127.0.0.1", file=sys.stderr)
        return 2
    try:
        worker_env = _parse_env(args.worker_env)
    except ValueError as exc:
        print(f"--worker-env: {exc}", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else DEFAULT_HOME / "models" / f"{args.task}-base"
    try:
        spec = spec_from_args(args, model=str(model.resolve()))
    except ValidationError as exc:
        print(f"spotrl up: invalid run options:\n{describe_errors(exc)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on SIGTERM as on Ctrl-C
    chaos = _chaos_options(args) if args.trace else None
    try:
        summary = up(
            DEFAULT_HOME,
            spec,
            args.reserved,
            args.preemptible,
            args.pretrain_steps,
            chaos,
            args.weightstores,
            args.engine,
            api_token=os.environ.get(TOKEN_VARIABLE) or None,
            port=args.port,
            worker_env=worker_env,
        )
    except KeyboardInterrupt:
        print(json.dumps({"state": "interrupted"}))
        return 130
    print(json.dumps(summary))
    ok = summary["state"] == "succeeded" and summary.get("groups_incomplete") == 0
    ok = ok and summary.get("lost") == 0 and summary.get("duplicated") == 0
    return 0 if ok else 1


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _parse_env(items: list[str]) -> dict[str, str]:
    """KEY=VALUE strings to a dict; KEY is an environment variable name."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        env[key] = value
    return env


def _chaos_options(args: argparse.Namespace):
    from services.cli.chaos import ChaosOptions

    return ChaosOptions(
        trace=Path(args.trace),
        time_scale=args.time_scale,
        max_workers=args.max_workers,
        hours=args.hours,
        start_s=args.start_hours * 3600,
        sigterm_fraction=args.sigterm_fraction,
        grace_s=args.grace_s,
    )


def _add_chaos_options(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--trace",
        required=required,
        help="spot availability CSV (seconds,available): preemptible workers follow it",
    )
    p.add_argument("--time-scale", type=float, default=600.0, help="trace seconds per wall second")
    p.add_argument("--max-workers", type=int, help="workers for the trace's largest fleet")
    p.add_argument("--hours", type=float, help="replay at most this many trace hours")
    p.add_argument("--start-hours", type=float, default=0.0, help="skip the trace's first hours")
    p.add_argument(
        "--sigterm-fraction",
        type=float,
        default=0.5,
        help="share of preemptions with notice (SIGTERM); the rest get SIGKILL",
    )
    p.add_argument("--grace-s", type=float, default=5.0, help="grace period after SIGTERM")


def _cmd_chaos(args: argparse.Namespace) -> int:
    """Replay a trace against a running deployment, starting workers from this machine."""
    import time

    from services.cli.chaos import ChaosRunner
    from services.cli.local_deployment import DeploymentConfig, LocalDeployment
    from services.common.settings import CommonSettings

    settings = CommonSettings()
    options = _chaos_options(args)
    targets = options.targets(args.max_workers or 2)
    config = DeploymentConfig(
        DEFAULT_HOME / "chaos",
        redis_url=settings.redis_url,
        api_token=settings.api_token,
        extra_env=options.worker_env(),
    )
    dep = LocalDeployment(config)
    dep.attach(settings.coordinator_url, settings.weightstore_url)
    runner = ChaosRunner(dep, targets, options.sigterm_fraction)
    signal.signal(signal.SIGTERM, _interrupt)
    runner.start()
    try:
        runner.wait()
        time.sleep(args.linger_s)
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
        dep.stop()
    print(json.dumps(runner.counts))
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from services.cli.up import ensure_model

    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        print(f"{out} already holds a model (use --force to rebuild)", file=sys.stderr)
        return 1
    if args.force:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    ensure_model(out, args.task, args.task_path, args.pretrain_steps)
    print(json.dumps({"model": str(out)}))
    return 0


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


def _cmd_submit(args: argparse.Namespace) -> int:
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


def _cmd_status(args: argparse.Namespace) -> int:
    from services.cli.follow import out, runs_table

    def status() -> int:
        with _client(args) as client:
            if args.run is None:
                runs = client.runs()
                if args.json:
                    print(json.dumps(runs))
                else:
                    out.print(runs_table(runs))
                return 0
            run = client.run(args.run) if args.json else _follow(client, args.run)
            print(json.dumps(run) if args.json else json.dumps(_brief(run)))
            return 0 if run["state"] != "failed" else 1

    return _api_call(status)


def _brief(run: dict) -> dict:
    keep = ("id", "state", "step", "steps", "reward_mean", "tokens_per_s", "t_seed_s", "error")
    return {k: run[k] for k in keep}


def _cmd_workers(args: argparse.Namespace) -> int:
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


def _cmd_cancel(args: argparse.Namespace) -> int:
    def cancel() -> int:
        with _client(args) as client:
            run = client.cancel(args.run)
        print(json.dumps(_brief(run)))
        return 0

    return _api_call(cancel)


def _cmd_logs(args: argparse.Namespace) -> int:
    from services.cli.follow import print_events

    def logs() -> int:
        with _client(args) as client:
            print_events(client, args.run, args.follow, out=lambda line: print(line, flush=True))
        return 0

    return _api_call(logs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "up",
        help="run the embedded default: every service locally, one RL run",
        description="Run the embedded default: every service as a local process, one RL run "
        "of the embedded preset (or of the run spec the flags below make), then a JSON summary.",
    )
    p.add_argument("--model", help="model folder (default: build one under $SPOTRL_HOME)")
    p.add_argument("--reserved", type=int, default=1, help="reserved rollout workers")
    p.add_argument("--preemptible", type=int, default=1, help="preemptible rollout workers")
    p.add_argument("--weightstores", type=int, default=1, help="weight-store replicas")
    p.add_argument(
        "--engine",
        default=RolloutSettings.model_fields["engine"].default,
        choices=get_args(RolloutSettings.model_fields["engine"].annotation),
        help="rollout backend (vllm: `make setup-vllm` first)",
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=EMBEDDED_PRETRAIN_STEPS,
        help="pre-training steps of the base model built when --model names none",
    )
    p.add_argument(
        "--port", type=int, help="coordinator port (API and dashboard; default: a free port)"
    )
    p.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the rollout workers only (repeatable), e.g. SPOTRL_DEVICE=cuda",
    )
    add_spec_flags(p)
    _add_chaos_options(p, required=False)
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("chaos", help="replay a spot trace: start and kill workers of a deployment")
    _add_chaos_options(p, required=True)
    p.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="keep the last workers this long after the trace ends",
    )
    p.set_defaults(func=_cmd_chaos)

    p = sub.add_parser("init-model", help="build and pre-train a small base model")
    p.add_argument("out")
    task = RunSpec.model_fields["task"]
    p.add_argument("--task", default=task.default, choices=get_args(task.annotation))
    p.add_argument("--task-path")
    p.add_argument("--pretrain-steps", type=int, default=EMBEDDED_PRETRAIN_STEPS)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=_cmd_init_model)

    url_variable = env_name(CommonSettings, "coordinator_url")
    url = os.environ.get(url_variable, CommonSettings.model_fields["coordinator_url"].default)

    def client_command(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text}. Writes send ${TOKEN_VARIABLE} as a bearer token.",
        )
        p.add_argument("--url", default=url, help=f"coordinator URL (${url_variable})")
        p.set_defaults(func=func)
        return p

    p = client_command("submit", "submit a run spec (TOML) to a coordinator", _cmd_submit)
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true", help="then show its progress to the end")

    p = client_command("status", "list the runs, or follow one with a progress bar", _cmd_status)
    p.add_argument("run", nargs="?")
    p.add_argument("--json", action="store_true", help="print JSON once, no progress bar")

    p = client_command("workers", "list the rollout workers", _cmd_workers)
    p.add_argument("--alive", action="store_true", help="only the alive ones")
    p.add_argument("--json", action="store_true")

    p = client_command("cancel", "cancel a queued or running run", _cmd_cancel)
    p.add_argument("run")

    p = client_command("logs", "print a run's events (workers, migrations, steps)", _cmd_logs)
    p.add_argument("run")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until it ends")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.common.logs import setup_logging

    setup_logging("spotrl", os.environ.get(env_name(CommonSettings, "log_level"), "WARNING"))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
