"""The `spotrl` argument parser: every subcommand, its flags and help texts, and the handler
each one runs (`args.func`). Building the parser imports no heavy module; the handlers live in
`local_commands` (this machine) and `coordinator_commands` (a deployed coordinator's API).
"""

import argparse
import os
from pathlib import Path
from typing import get_args

from services.cli.coordinator_commands import (
    cmd_cancel,
    cmd_logs,
    cmd_pause,
    cmd_status,
    cmd_submit,
    cmd_workers,
)
from services.cli.environment import TOKEN_VARIABLE
from services.cli.local_commands import cmd_chaos, cmd_init_model, cmd_up
from services.cli.scale import cmd_scale
from services.cli.scale_settings import ScaleSettings
from services.cli.secrets_command import DEFAULT_REDIS_URL, bounded_days, cmd_secrets, parse_hosts
from services.cli.spec_flags import add_spec_flags
from services.cli.tls_folder import (
    CA_VALID_DAYS,
    MAX_CA_VALID_DAYS,
    MAX_SERVER_VALID_DAYS,
    SERVER_VALID_DAYS,
)
from services.contracts.runspec import EMBEDDED_PRETRAIN_STEPS, FLAT_FIELDS
from services.infra.settings import CommonSettings, env_name
from services.rollout.settings import RolloutSettings

DESCRIPTION = "The `spotrl` command line."

# argparse's type for the object `add_subparsers` returns
Subparsers = argparse._SubParsersAction


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotrl", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_chaos(sub)
    _add_init_model(sub)
    _add_coordinator_commands(sub)
    _add_scale(sub)
    _add_secrets(sub)
    return parser


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


def _add_up(sub: Subparsers) -> None:
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
        help="pre-training steps of the base model built when --model names none (default: "
        f"the task's; arithmetic {EMBEDDED_PRETRAIN_STEPS})",
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
    p.add_argument(
        "--no-p2p",
        action="store_true",
        help="workers take every weight block from the weight store (default: also from the "
        "workers that hold it, each on a free port its /v1/status names)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="every hop over TLS: a throwaway CA and certificate under the run's folder",
    )
    p.add_argument(
        "--open",
        action="store_true",
        help="one Redis user and one API token for everything, as before least privilege "
        "(default: a Redis user per role and per worker, a token per scope; the admin token, "
        f"${TOKEN_VARIABLE} if set, is written to the run folder's admin-token)",
    )
    add_spec_flags(p)
    _add_chaos_options(p, required=False)
    p.add_argument(
        "--hold-all-offered",
        action="store_true",
        help="with --trace: hold every worker the trace offers (default: no more than the "
        "coordinator's preemptible_wanted, as a scaler should)",
    )
    p.set_defaults(func=cmd_up)


def _add_chaos(sub: Subparsers) -> None:
    p = sub.add_parser("chaos", help="replay a spot trace: start and kill workers of a deployment")
    _add_chaos_options(p, required=True)
    p.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="keep the last workers this long after the trace ends",
    )
    p.set_defaults(func=cmd_chaos)


def _add_init_model(sub: Subparsers) -> None:
    p = sub.add_parser("init-model", help="build and pre-train a small base model")
    p.add_argument("out")
    task = FLAT_FIELDS["task"]
    p.add_argument("--task", default=task.default, choices=get_args(task.annotation))
    p.add_argument("--task-path")
    p.add_argument(
        "--pretrain-steps",
        type=int,
        help=f"default: the task's (arithmetic {EMBEDDED_PRETRAIN_STEPS}; "
        "services/trainer/init_model.py TASK_MODEL_DEFAULTS)",
    )
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_init_model)


def _add_coordinator_commands(sub: Subparsers) -> None:
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

    p = client_command("submit", "submit a run spec (TOML) to a coordinator", cmd_submit)
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true", help="then show its progress to the end")

    p = client_command("status", "list the runs, or follow one with a progress bar", cmd_status)
    p.add_argument("run", nargs="?")
    p.add_argument("--json", action="store_true", help="print JSON once, no progress bar")

    p = client_command("workers", "list the rollout workers", cmd_workers)
    p.add_argument("--alive", action="store_true", help="only the alive ones")
    p.add_argument("--json", action="store_true")

    p = client_command("cancel", "cancel a queued or running run", cmd_cancel)
    p.add_argument("run")

    p = client_command(
        "pause", "pause an active run: no new step opens until it is resumed", cmd_pause
    )
    p.add_argument("run")
    p.set_defaults(order="pause")
    p = client_command("resume", "let a paused run open steps again", cmd_pause)
    p.add_argument("run")
    p.set_defaults(order="resume")

    p = client_command("logs", "print a run's events (workers, migrations, steps)", cmd_logs)
    p.add_argument("run")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until it ends")


def _add_secrets(sub: Subparsers) -> None:
    p = sub.add_parser(
        "secrets",
        help="write the credentials of a Compose or Swarm deployment, a file per service",
        description="Write OUT (0700, files 0600): Redis's ACL file (redis/users.acl), an env "
        "file per service (its token, the tokens it accepts, its Redis user; a rollout "
        "worker's holds no admin token and no Redis password), redis.env (the healthcheck's "
        f"read-only user), admin.env (${TOKEN_VARIABLE} for the CLI; kept from the environment "
        "when set), and with --tls a CA (ca/, kept) and a certificate it signs (tls/). "
        "--renew re-signs that certificate. docker-compose.yml reads them from $SPOTRL_SECRETS "
        "(./secrets).",
    )
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help=f"Redis as the services reach it, no credentials (default {DEFAULT_REDIS_URL}, "
        "Compose's network); with --tls the scheme becomes rediss://",
    )
    p.add_argument("--tls", action="store_true", help="also a CA and a certificate")
    p.add_argument(
        "--hosts",
        type=parse_hosts,
        help="with --tls: the certificate's names, comma separated: every address and name the "
        "services are reached by (the reserved node's address, each node's name)",
    )
    p.add_argument("--force", action="store_true", help="replace the secrets already in OUT")
    p.add_argument(
        "--valid-days",
        type=bounded_days(MAX_SERVER_VALID_DAYS),
        help=f"with --tls or --renew: the certificate's life in days (default "
        f"{SERVER_VALID_DAYS}, at most {MAX_SERVER_VALID_DAYS})",
    )
    p.add_argument(
        "--ca-valid-days",
        type=bounded_days(MAX_CA_VALID_DAYS),
        help=f"with --tls: the CA's life in days (default {CA_VALID_DAYS}); it is kept in "
        "OUT/ca/, which no service mounts",
    )
    p.add_argument(
        "--renew",
        action="store_true",
        help="re-sign OUT/tls/tls.crt (a new key, the same hosts) with the CA kept in OUT/ca/; "
        "nothing else changes",
    )
    p.set_defaults(func=cmd_secrets)


def _add_scale(sub: Subparsers) -> None:
    url_variable = env_name(CommonSettings, "coordinator_url")
    url = os.environ.get(url_variable, CommonSettings.model_fields["coordinator_url"].default)
    fields = ScaleSettings.model_fields
    p = sub.add_parser(
        "scale",
        help="hold a preemptible rollout pool at the coordinator's preemptible_wanted",
        description="Every --interval seconds, read the run's preemptible_wanted from the "
        "coordinator and set the replica count of a preemptible rollout pool (a Kubernetes "
        "Deployment, a Swarm service, a Compose service) within the bounds, after the "
        f"cooldowns. One log line and one metric per decision. Reads send ${TOKEN_VARIABLE} "
        "as a bearer token. With no active run the pool goes to --min. Exit codes: 1 "
        "coordinator, 2 options, 3 no such run, 4 no such deployment or service, 5 engine error.",
    )
    p.add_argument("--url", default=url, help=f"coordinator URL (${url_variable})")
    p.add_argument("--run", help="run to follow (default: every active run)")
    p.add_argument("--target", required=True, choices=("k8s", "swarm", "compose"))
    p.add_argument(
        "--min",
        type=int,
        default=fields["min_replicas"].default,
        help="fewest held, and what is held with no run",
    )
    p.add_argument("--max", type=int, required=True, help="most replicas held")
    p.add_argument("--interval", type=float, default=fields["interval_s"].default, help="seconds")
    p.add_argument(
        "--cooldown",
        type=float,
        help=f"seconds after a change before the next, up or down (default: "
        f"{fields['up_cooldown_s'].default:.0f} up, {fields['down_cooldown_s'].default:.0f} down)",
    )
    p.add_argument("--up-cooldown", type=float, help="seconds after a change before scaling up")
    p.add_argument("--down-cooldown", type=float, help="... before scaling down")
    p.add_argument(
        "--when-unknown",
        default=fields["when_unknown"].default,
        choices=("hold", "max"),
        help="no figure yet (no step trained): keep the replicas found, or go to --max",
    )
    p.add_argument("--dry-run", action="store_true", help="decide and log; change nothing")
    p.add_argument("--once", action="store_true", help="one decision, then exit")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1")
    k8s = p.add_argument_group("--target k8s")
    k8s.add_argument("--namespace", default=fields["namespace"].default)
    k8s.add_argument("--deployment", help="the Deployment of the preemptible pool")
    k8s.add_argument("--kubeconfig", help="default: in-cluster, else $KUBECONFIG")
    k8s.add_argument("--context", help="kubeconfig context (default: its current one)")
    engine = p.add_argument_group("--target swarm / compose (DOCKER_HOST names the daemon)")
    engine.add_argument("--service", help="the service of the preemptible pool")
    engine.add_argument("--project", help="compose: the project name")
    engine.add_argument("--file", "-f", action="append", default=[], help="compose file(s)")
    p.set_defaults(func=cmd_scale)
