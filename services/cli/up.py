"""`spotrl up`: the embedded default. Starts every service as a local process, builds the base
model if it is missing, submits one run, shows its progress, restarts rollout workers that die
(`services.cli.supervisor`), stops everything on exit or Ctrl-C and prints a JSON summary as the
last line. It exits through `UpAborted` when a core service dies or the run cannot progress.
Killed outright (SIGKILL, the OOM killer), it takes every process it started with it
(`procs.start`); SIGTERM stops them as Ctrl-C does. The summary is made in up_summary.py.
"""

import dataclasses
import json
import os
import secrets
import time
from pathlib import Path

import httpx

from services.cli.chaos import ChaosOptions, ChaosRunner
from services.cli.client import CoordinatorClient, CoordinatorError
from services.cli.follow import console, follow_run, progress_bar
from services.cli.local_deployment import DeploymentConfig, LocalDeployment
from services.cli.procs import Proc, ProcessDied
from services.cli.supervisor import Death, StallGuard, WorkerSupervisor
from services.cli.up_summary import aborted_summary, finished_summary
from services.contracts.runspec import RunSpec


def base_model_spec(task: str, task_path: str | None, pretrain_steps: int | None):
    """The base model `spotrl up` and `spotrl init-model` build for `task`: its defaults
    (`InitModelSpec`'s, the task's over them), `pretrain_steps` over both when given."""
    from services.trainer.init_model import InitModelSpec

    given = {} if pretrain_steps is None else {"pretrain_steps": pretrain_steps}
    return InitModelSpec(task=task, task_path=task_path, **given)


def built_with(model: Path):
    """The spec the model in `model` was built with (spotrl-init.json), or None."""
    from pydantic import ValidationError

    from services.trainer.init_model import InitModelSpec

    try:
        return InitModelSpec.model_validate_json((model / "spotrl-init.json").read_text())
    except (OSError, ValidationError):
        return None


def ensure_model(
    model: Path,
    task: str,
    task_path: str | None,
    pretrain_steps: int | None,
    rebuild_other: bool = False,
) -> Path:
    """The model in `model`, built first when there is none, or with `rebuild_other` (the
    folder `spotrl up` names itself) when the one there was built with another spec."""
    spec = base_model_spec(task, task_path, pretrain_steps)
    if (model / "config.json").is_file():
        if not rebuild_other or built_with(model) == spec:
            return model
        console.print(f"{model} was built with another spec: building it again", soft_wrap=True)
    from services.trainer.init_model import init_model

    with progress_bar("pre-training base model") as bar:
        task_id = bar.add_task("init-model", total=spec.pretrain_steps, info="")
        init_model(
            model,
            spec,
            lambda s, n, loss: bar.update(task_id, completed=s, info=f"loss {loss:.3f}"),
        )
    return model


class UpAborted(RuntimeError):
    """`spotrl up` stopped before the run reached a final state; the message says why."""


def new_run_dir(work_dir: Path) -> Path:
    """A folder of its own for each invocation, even two started in the same second."""
    run_dir = work_dir / f"{time.strftime('up-%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def announce(proc: Proc) -> None:
    """Say where a service answers as soon as it does."""
    if proc.name == "coordinator":
        console.print(f"coordinator API {proc.url} (dashboard {proc.url}/)", soft_wrap=True)
    elif proc.name.startswith("weightstore"):
        console.print(f"{proc.name.replace('weightstore', 'weight store')} {proc.url}")
    elif proc.name == "trainer":
        console.print(f"trainer {proc.url}")


def report_death(death: Death) -> None:
    console.print(
        f"worker {death.worker} died (exit {death.exit_code}, up {death.uptime_s:.1f} s): "
        f"{death.headline}",
        style="bold red",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for line in death.log_tail.splitlines():
        console.print(f"  | {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"restarting it in {death.restart_in_s:g} s", soft_wrap=True)


def local_sizing(spec: RunSpec, preemptible: int, cores: int) -> tuple[int, int]:
    """A local deployment's worker slots and trainer threads. Slots: a whole step at once (B x n,
    64 to 1024): the hf engine prefills the running set again whenever a request joins, so one
    wave is its cheapest, and the read cap still shares a step among workers. Threads: with no
    preemptible worker the trainer and the reserved workers take turns (a step is synchronous),
    so the trainer may use two cores; beside preemptible workers, which generate while it
    trains, one."""
    slots = min(max(spec.training.prompts_per_step * spec.training.group_size, 64), 1024)
    trainer_threads = 2 if preemptible == 0 and cores >= 2 else 1
    return slots, trainer_threads


def sized_for(config: DeploymentConfig, spec: RunSpec, cores: int) -> DeploymentConfig:
    """The deployment `config` with the worker slots, trainer threads and reward modules that
    `spec` asks for (`local_sizing`)."""
    slots, trainer_threads = local_sizing(spec, config.preemptible, cores)
    # who runs `spotrl up` is the operator: the reward it names may be imported
    reward_module = spec.scoring.reward_module()
    return dataclasses.replace(
        config,
        worker_slots=slots,
        trainer_threads=trainer_threads,
        reward_modules=[reward_module] if reward_module else [],
    )


def up(
    work_dir: Path,
    spec: RunSpec,
    reserved: int,
    preemptible: int,
    pretrain_steps: int | None,
    chaos: ChaosOptions | None = None,
    weightstores: int = 1,
    engine: str = "hf",
    api_token: str | None = None,
    port: int | None = None,
    worker_env: dict[str, str] | None = None,
    secure: bool = True,
    tls: bool = False,
    rebuild_other: bool = False,
) -> dict:
    """Run `spec` on a local deployment (its model folder is built first when missing, or
    built with another spec and `rebuild_other`: `ensure_model`); the summary that `spotrl up`
    prints."""
    started = time.monotonic()
    ensure_model(
        Path(spec.model), spec.data.task, spec.data.task_path, pretrain_steps, rebuild_other
    )
    run_dir = new_run_dir(work_dir)
    targets = chaos.targets(preemptible) if chaos else []
    if targets:
        preemptible = targets[0][1]
    config = DeploymentConfig(
        run_dir,
        reserved=reserved,
        preemptible=preemptible,
        api_token=api_token,
        coordinator_port=port,
        weightstores=weightstores,
        engine=engine,
        extra_env=chaos.worker_env() if chaos else {},
        worker_env=worker_env or {},
        secure=secure,
        tls=tls,
    )
    config = sized_for(config, spec, os.cpu_count() or 1)
    deployment = LocalDeployment(config)
    console.print(f"starting services (logs in {run_dir / 'logs'})", soft_wrap=True)
    try:
        summary, supervisor = drive(deployment, spec, chaos, targets, run_dir, started)
    finally:
        console.print("stopping services")
        deployment.stop()
    summary["seed"] = spec.seed
    summary["lora_r"] = spec.lora.lora_r if spec.lora.use_peft else None  # None: full weights
    summary["run_dir"] = str(run_dir)
    summary["worker_restarts"] = supervisor.restarts if supervisor else 0
    summary["worker_last_error"] = supervisor.last_error if supervisor else ""
    return summary


def drive(
    deployment: LocalDeployment,
    spec: RunSpec,
    chaos: ChaosOptions | None,
    targets: list[tuple[float, int]],
    run_dir: Path,
    started: float,
) -> tuple[dict, WorkerSupervisor | None]:
    """Start the deployment, submit the run and follow it to a final state (or stop early:
    the summary says why); the summary, and the supervisor if it started. The chaos replay
    is stopped on the way out, the deployment is not."""
    runner = None
    run: dict = {"id": None, "state": "queued", "step": 0}
    supervisor = None
    try:
        deployment.start(on_ready=announce)
        if deployment.credentials is not None:
            token_file = deployment.work_dir / "admin-token"
            console.print(f"admin token (SPOTRL_API_TOKEN for the CLI): {token_file}")
        supervisor = watch_workers(deployment, chaos)
        client = CoordinatorClient(
            deployment.coordinator_url, deployment.admin_token, ca_file=deployment.ca_file
        )
        run["id"] = client.submit(json.loads(spec.model_dump_json()))
        runner = start_chaos(deployment, chaos, targets, spec.seed, run)
        guard = StallGuard(spec.faults.stall_timeout_s)
        run = follow_supervised(client, deployment, run, supervisor, guard)
        if runner:
            runner.stop()
        summary = finished_summary(client, deployment, run, spec, run_dir, started)
        summary["engine"] = deployment.config.engine
        if runner:
            summary["chaos"] = runner.counts
    except (ProcessDied, UpAborted, CoordinatorError) as exc:
        console.print(f"spotrl up stopped: {exc}", style="bold red", markup=False, soft_wrap=True)
        summary = aborted_summary(exc, run, time.monotonic() - started)
    finally:
        if runner:
            runner.stop()
    return summary, supervisor


def watch_workers(deployment: LocalDeployment, chaos: ChaosOptions | None) -> WorkerSupervisor:
    """The supervisor that restarts the workers that die, but those the chaos replay owns (it
    starts and kills the preemptible workers on purpose)."""
    watched = [p.name for p in deployment.workers() if not (chaos and "-preemptible-" in p.name)]
    return WorkerSupervisor(deployment, watched, time.monotonic, report_death)


def start_chaos(
    deployment: LocalDeployment,
    chaos: ChaosOptions | None,
    targets: list[tuple[float, int]],
    seed: int,
    run: dict,
) -> ChaosRunner | None:
    """The chaos replay, started (None without one). With `follow_wanted` it is the scaler: no
    more workers than the coordinator wants, as `run` (kept up to date) says."""
    if not chaos:
        return None
    wanted = (lambda: run.get("preemptible_wanted")) if chaos.follow_wanted else None
    runner = ChaosRunner(deployment, targets, chaos.sigterm_fraction, seed, wanted=wanted)
    runner.start()
    return runner


def follow_supervised(
    client: CoordinatorClient,
    deployment: LocalDeployment,
    run: dict,
    supervisor: WorkerSupervisor,
    guard: StallGuard,
) -> dict:
    """Follow the run to a final state while restarting the workers that die; `run` is kept
    up to date for the caller. Raises ProcessDied (a core service died) or UpAborted."""

    def check(current: dict) -> None:
        run.update(current)
        deployment.check_alive()
        supervisor.poll()
        now = time.monotonic()
        reason = guard.check(current, now, supervisor.crash_looping(), supervisor.last_error)
        if reason:
            raise UpAborted(reason)

    def note() -> str:
        return f"worker restarts {supervisor.restarts}" if supervisor.restarts else ""

    try:
        return follow_run(client, run["id"], check, note=note)
    except httpx.HTTPError:
        deployment.check_alive()  # a dead coordinator says so; anything else goes up
        raise
