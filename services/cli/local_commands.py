"""The subcommands that run on this machine: `up` (every service as a local process, one run),
`chaos` (replay a spot trace against a deployment) and `init-model`. Each takes the parsed
arguments and returns the exit code; heavy modules are imported only when a command runs.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from services.cli.environment import DEFAULT_HOME, TOKEN_VARIABLE


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from services.cli.spec_flags import describe_errors, spec_from_args
    from services.cli.up import up

    error = _up_usage_error(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    try:
        worker_env = parse_env(args.worker_env)
    except ValueError as exc:
        print(f"--worker-env: {exc}", file=sys.stderr)
        return 2
    if args.no_p2p:
        from services.infra.settings import env_name
        from services.rollout.settings import RolloutSettings

        worker_env[env_name(RolloutSettings, "p2p")] = "false"
    error = _dataset_usage_error(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else DEFAULT_HOME / "models" / f"{args.task}-base"
    try:
        spec = spec_from_args(args, model=str(model.resolve()))
    except ValidationError as exc:
        print(f"spotrl up: invalid run options:\n{describe_errors(exc)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services on SIGTERM as on Ctrl-C
    chaos = chaos_options(args) if args.trace else None
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
            secure=not args.open,
            tls=args.tls,
            rebuild_other=not args.model,  # its own folder holds the task's model as specified
        )
    except KeyboardInterrupt:
        print(json.dumps({"state": "interrupted"}))
        return 130
    print(json.dumps(summary))
    ok = summary["state"] == "succeeded" and summary.get("groups_incomplete") == 0
    ok = ok and summary.get("lost") == 0 and summary.get("duplicated") == 0
    return 0 if ok else 1


def _up_usage_error(args: argparse.Namespace) -> str | None:
    """The first problem with `up`'s fleet, engine or port options, or None."""
    if args.weightstores < 1:
        return "spotrl up needs at least one weight store (--weightstores)"
    if args.reserved < 0 or args.preemptible < 0 or args.reserved + args.preemptible < 1:
        return "spotrl up needs at least one rollout worker (--reserved/--preemptible)"
    if args.engine == "vllm":
        from services.rollout.engines.vllm import VLLMUnavailable, import_vllm

        try:
            import_vllm()  # fail now, with the install command, rather than in every worker
        except VLLMUnavailable as exc:
            return f"spotrl up --engine vllm: {exc}"
    if args.port is not None and not 1 <= args.port <= 65535:
        return f"--port {args.port}: a TCP port is 1..65535"
    if args.port is not None and not _port_free(args.port):
        # else another service on it could answer for our coordinator
        return f"--port {args.port}: in use on 127.0.0.1"
    return None


def _dataset_usage_error(args: argparse.Namespace) -> str | None:
    """With --dataset: the run's task is `dataset` (the --task flag's default is a built-in) and
    a file's path absolute (the coordinator reads it); None, or what is wrong."""
    if args.dataset is None:
        return None
    if not args.model:
        return (
            "spotrl up --dataset needs --model: the base model spotrl up builds knows only the "
            "arithmetic task"
        )
    from services.contracts.runspec import FLAT_FIELDS

    if args.task == FLAT_FIELDS["task"].default:
        args.task = "dataset"
    if Path(args.dataset).exists():
        args.dataset = str(Path(args.dataset).resolve())
    return None


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def parse_env(items: list[str]) -> dict[str, str]:
    """KEY=VALUE strings to a dict; KEY is an environment variable name."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        env[key] = value
    return env


def chaos_options(args: argparse.Namespace):
    from services.cli.chaos import ChaosOptions

    return ChaosOptions(
        trace=Path(args.trace),
        time_scale=args.time_scale,
        max_workers=args.max_workers,
        hours=args.hours,
        start_s=args.start_hours * 3600,
        sigterm_fraction=args.sigterm_fraction,
        grace_s=args.grace_s,
        follow_wanted=not getattr(args, "hold_all_offered", False),  # an `up` flag
    )


def cmd_chaos(args: argparse.Namespace) -> int:
    """Replay a trace against a running deployment, starting workers from this machine."""
    import time

    from services.cli.chaos import ChaosRunner
    from services.cli.local_deployment import DeploymentConfig, LocalDeployment
    from services.infra.settings import CommonSettings

    settings = CommonSettings()
    options = chaos_options(args)
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


def cmd_init_model(args: argparse.Namespace) -> int:
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
