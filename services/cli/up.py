"""`spotrl up`: the embedded default. Starts every service as a local process, builds the base
model if it is missing, submits one run, shows its progress, stops everything on exit or Ctrl-C
and prints a JSON summary as the last line.
"""

import json
import time
from pathlib import Path

from services.cli.audit import audit_run
from services.cli.chaos import ChaosOptions, ChaosRunner
from services.cli.client import CoordinatorClient
from services.cli.deploy import Deployment, DeploymentConfig
from services.cli.follow import console, follow_run, progress_bar
from services.cli.plots import plot_run
from services.common.runspec import RunSpec


def ensure_model(model: Path, task: str, task_path: str | None, pretrain_steps: int) -> Path:
    if (model / "config.json").is_file():
        return model
    from services.trainer.init_model import InitModelSpec, init_model

    spec = InitModelSpec(task=task, task_path=task_path, pretrain_steps=pretrain_steps)
    with progress_bar("pre-training base model") as bar:
        task_id = bar.add_task("init-model", total=spec.pretrain_steps, info="")
        init_model(
            model,
            spec,
            lambda s, n, loss: bar.update(task_id, completed=s, info=f"loss {loss:.3f}"),
        )
    return model


def migration_totals(rows: list[dict]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in rows:
        for cause, n in (row.get("migrations") or {}).items():
            totals[cause] = totals.get(cause, 0) + n
    return totals


def summarize(run: dict, rows: list[dict], wall_s: float) -> dict:
    rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
    tps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]
    return {
        "run_id": run["id"],
        "state": run["state"],
        "steps": run["step"],
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "groups_incomplete": run["groups_incomplete"],
        "tokens_per_s_mean": sum(tps) / len(tps) if tps else None,
        "migrations": migration_totals(rows),
        "t_seed_s_last": next((r["t_seed_s"] for r in reversed(rows) if "t_seed_s" in r), None),
        "n_prem_recommended": run.get("n_prem_recommended"),
        "wall_s": round(wall_s, 1),
    }


def up(
    work_dir: Path,
    model: Path,
    task: str,
    steps: int,
    reserved: int,
    preemptible: int,
    spec_overrides: dict,
    pretrain_steps: int,
    chaos: ChaosOptions | None = None,
    weightstores: int = 1,
    engine: str = "hf",
) -> dict:
    started = time.monotonic()
    ensure_model(model, task, spec_overrides.get("task_path"), pretrain_steps)
    spec = RunSpec(model=str(model.resolve()), task=task, steps=steps, **spec_overrides)
    run_dir = work_dir / time.strftime("up-%Y%m%d-%H%M%S")
    targets = chaos.targets(preemptible) if chaos else []
    if targets:
        preemptible = targets[0][1]
    config = DeploymentConfig(
        run_dir,
        reserved=reserved,
        preemptible=preemptible,
        weightstores=weightstores,
        engine=engine,
        extra_env=chaos.worker_env() if chaos else {},
    )
    deployment = Deployment(config)
    console.print(f"starting services (logs in {run_dir / 'logs'})")
    deployment.start()
    runner = None
    try:
        client = CoordinatorClient(deployment.coordinator_url)
        run_id = client.submit(json.loads(spec.model_dump_json()))
        if chaos:
            runner = ChaosRunner(deployment, targets, chaos.sigterm_fraction, spec.seed)
            runner.start()
        run = follow_run(client, run_id, deployment.check_alive)
        if runner:
            runner.stop()
        rows = client.metrics(run_id)
        (run_dir / "metrics.json").write_text(json.dumps(rows, indent=1))
        summary = summarize(run, rows, time.monotonic() - started)
        summary["engine"] = engine
        summary["metrics_file"] = str(run_dir / "metrics.json")
        summary["plot"] = str(plot_run(rows, run_dir / "metrics.png", f"spotrl run {run_id}"))
        audit = audit_run(deployment.redis_url, run_id, spec, steps=run["step"])
        summary |= {"lost": audit["lost"], "duplicated": audit["duplicated"]}
        if runner:
            summary["chaos"] = runner.counts
        return summary
    finally:
        if runner:
            runner.stop()
        console.print("stopping services")
        deployment.stop()
