"""The stack as a user runs it with Docker Compose, on an engine of the test's own.

Built offline (`tools/offline-image.sh`), started by `docker compose` with
docker-compose.hostnet.yml (every service on the host's network, bound to 127.0.0.1, ports from
variables) with the credentials of `spotrl secrets` (a Redis user per role, the workers' minted
at registration, a token per scope), driven through the REST API with the admin token, audited
as Redis's read-only user: a GRPO run whose steps advance and whose
reward rises; rollout scaled to 2 mid-run by `spotrl scale --target compose`, both replicas
producing tokens; one rollout container killed mid-step (the run goes on, the audit finds
nothing lost or duplicated); the trainer container restarted (it resumes from its
checkpoint); `down -v` leaves nothing behind. The run's model is the embedded one, pre-trained on
the host while the image builds and shared with the Swarm test (tests/harness/models.py); `spotrl
init-model` runs in the trainer's container too, for a few steps.

`python -m tests.compose.scenario` prints the summary as JSON, last line; the pytest marker
`compose` (tests/compose/test_compose_up.py) asserts it.
"""

import ipaddress
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.cli.audit import audit_run
from services.cli.client import CoordinatorClient
from services.cli.credentials import Credentials
from services.cli.procs import free_port
from services.cli.secrets_command import write_secrets
from services.contracts.runspec import RunSpec
from tests.compose.engine import DockerEngine, compose_binary
from tests.harness.models import build_beside, copy_model
from tests.integration.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
FILES = ("docker-compose.yml", "docker-compose.hostnet.yml")
MODEL = "/models/arithmetic-base"
INIT_CHECK = "/models/init-check"  # what the in-container `spotrl init-model` writes
PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
FINAL = {"succeeded", "failed", "cancelled"}
# Long enough that the run outlasts the scale-up, the kill and the trainer's restart on a fast
# machine: a step here takes ~0.4 s, and those events take ~10-20 s of the run.
STEPS = 120


def say(msg: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Stack:
    """One Compose project on the engine: its commands, containers and REST client."""

    def __init__(self, engine: DockerEngine, work: Path) -> None:
        self.engine = engine
        self.project = f"spotrl-test-{secrets.token_hex(3)}"
        self.ports = {n: free_port() for n in ("redis", "coordinator", "weightstore", "trainer")}
        models = self.models = work / "models"
        models.mkdir(parents=True, exist_ok=True)
        models.chmod(0o777)  # the services run as uid 10001
        # `spotrl secrets`, with Redis where docker-compose.hostnet.yml puts it
        self.redis_url = f"redis://127.0.0.1:{self.ports['redis']}/0"
        credentials = Credentials.make()
        write_secrets(work / "secrets", credentials, self.redis_url)
        self.token = credentials.admin_token
        self.reader_url = credentials.redis_url(self.redis_url, "reader")  # the audit's
        # what no rollout container may hold: the admin and trainer tokens, a role's password
        self.not_for_workers = [
            credentials.tokens["admin"],
            credentials.tokens["trainer"],
            *credentials.redis_passwords.values(),
        ]
        self.env = {
            **engine.env(),
            "SPOTRL_SECRETS": str(work / "secrets"),
            "SPOTRL_API_TOKEN": self.token,  # the CLI's (`spotrl scale`); no container gets it
            "SPOTRL_MODELS": str(models),
            "SPOTRL_REDIS_IMAGE": "spotrl-base:bookworm",
            "SPOTRL_REDIS_PORT": str(self.ports["redis"]),
            "SPOTRL_COORDINATOR_PORT": str(self.ports["coordinator"]),
            "SPOTRL_WEIGHTSTORE_PORT": str(self.ports["weightstore"]),
            "SPOTRL_TRAINER_PORT": str(self.ports["trainer"]),
            "SPOTRL_TRAINER_THREADS": "1",
            "SPOTRL_ROLLOUT_THREADS": "1",
        }
        self.client = CoordinatorClient(f"http://127.0.0.1:{self.ports['coordinator']}", self.token)

    def spotrl_scale(self, *args: str) -> str:
        """`spotrl scale --target compose` on this project's rollout service, for real; its
        decision's log line."""
        cmd = [sys.executable, "-m", "services.cli.main", "scale", "--target", "compose"]
        url = f"http://127.0.0.1:{self.ports['coordinator']}"
        cmd += ["--url", url, "--project", self.project, "--service", "rollout"]
        for f in FILES:
            cmd += ["-f", str(ROOT / f)]
        env = {**self.env, "SPOTRL_LOG_LEVEL": "INFO"}
        out = subprocess.run(
            [*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        if out.returncode != 0:
            raise RuntimeError(f"spotrl scale: exit {out.returncode}: {out.stderr[-2000:]}")
        return next(line for line in out.stderr.splitlines() if "reason=" in line)

    def compose(self, *args: str, timeout_s: float = 600.0, check: bool = True):
        cmd = [str(compose_binary()), "--project-directory", str(ROOT), "-p", self.project]
        for f in FILES:
            cmd += ["-f", str(ROOT / f)]
        out = subprocess.run(
            [*cmd, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)}: {out.stderr[-2000:]}")
        return out

    def containers(self, service: str | None = None, running: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        listing = self.engine.docker("ps", "-q", *([] if running else ["-a"]), *filters)
        return listing.stdout.split()

    def private_addresses(self) -> list[str]:
        """Addresses any container of the project has on a private (bridge) network."""
        found = []
        for cid in self.containers():
            nets = json.loads(
                self.engine.docker(
                    "inspect", "-f", "{{json .NetworkSettings.Networks}}", cid
                ).stdout
            )
            for net in nets.values():
                ip = net.get("IPAddress")
                if ip and any(ipaddress.ip_address(ip) in p for p in PRIVATE):
                    found.append(f"{cid[:12]}: {ip}")
        return found

    def worker_secrets(self) -> list[str]:
        """The secrets a rollout container's environment holds that only others should."""
        found = []
        for cid in self.containers("rollout", running=True):
            env = self.engine.docker("inspect", "-f", "{{json .Config.Env}}", cid).stdout
            found += [
                f"{cid[:12]}: secret {i}" for i, x in enumerate(self.not_for_workers) if x in env
            ]
        return found

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = [f"container {c}" for c in self.containers()]
        for kind in ("volume", "network"):
            listing = self.engine.docker(kind, "ls", "-q", "--filter", label)
            out += [f"{kind} {x}" for x in listing.stdout.split()]
        return out

    def rollout_workers(self, run_id: str) -> list[dict]:
        return [
            w
            for w in self.client.workers()
            if w.get("alive") and w.get("run_id") == run_id and w["pool"] == "preemptible"
        ]


def drive(stack: Stack, steps: int, summary: dict) -> None:
    client = stack.client
    # the embedded model, built once on the host for this test and the Swarm test (run_scenario)
    copy_model("embedded", stack.models / Path(MODEL).name)
    # `spotrl init-model` as a user runs it, in the trainer's container (a few steps: the path
    # is what is checked here, the embedded model's pre-training takes minutes)
    say("init-model (compose run --rm --no-deps trainer), 5 steps")
    stack.compose(
        "run", "--rm", "--no-deps", "trainer", "spotrl", "init-model", INIT_CHECK,
        "--pretrain-steps", "5", timeout_s=600.0,
    )  # fmt: skip
    summary["init_model_in_container"] = (
        stack.models / Path(INIT_CHECK).name / "config.json"
    ).is_file()

    t_up = time.monotonic()
    stack.compose("up", "-d", "--wait", "--wait-timeout", "300")
    summary["up_healthy_s"] = round(time.monotonic() - t_up, 1)
    say(f"healthy after {summary['up_healthy_s']} s")
    summary["private_addresses"] = stack.private_addresses()

    spec = {
        "model": MODEL,
        "task": "arithmetic",
        "steps": steps,
        "prompts_per_step": 32,
        "group_size": 8,
        "seed": 0,
    }
    run_id = client.submit(spec)
    t_run = time.monotonic()

    def step() -> int:
        return client.run(run_id)["step"]

    def reached(n: int) -> bool:
        """Step `n` reached or the run over: one read of the run."""
        run = client.run(run_id)
        return run["step"] >= n or run["state"] in FINAL

    wait_until(lambda: step() >= 1, "the first step", 300, poll_s=0.5)
    summary["first_step_s"] = round(time.monotonic() - t_run, 1)
    say(f"first step after {summary['first_step_s']} s")

    # `spotrl scale` grows the rollout service to 2 (its bounds: 2..2; the figure or not)
    scaled = stack.spotrl_scale("--min", "2", "--max", "2", "--when-unknown", "max", "--once")
    summary["scale_decision"] = scaled
    both = wait_until(
        lambda: (
            ws
            if len(ws := [w for w in stack.rollout_workers(run_id) if w["tokens_generated"] > 0])
            >= 2
            else None
        ),
        "two rollout replicas producing tokens",
        240,
        poll_s=0.5,
    )
    summary["workers_max"] = len(both)
    summary["worker_secrets"] = stack.worker_secrets()
    say(f"{len(both)} rollout replicas producing tokens")

    # kill one replica while it holds requests of the step in flight
    held = wait_until(
        lambda: [w for w in stack.rollout_workers(run_id) if w["active"] > 0],
        "a replica holding requests",
        120,
        poll_s=0.05,
    )
    replicas = stack.containers("rollout", running=True)
    at_kill = step()
    stack.engine.docker("kill", replicas[-1])
    summary["killed"] = 1
    say(f"killed a rollout container at step {at_kill} ({held[0]['active']} requests held)")
    wait_until(lambda: reached(at_kill + 2), "steps after the kill", 300, poll_s=0.5)

    at_restart = step()
    stack.compose("restart", "-t", "30", "trainer")
    summary["trainer_resumed"] = bool(
        wait_until(
            lambda: "from its checkpoint" in stack.compose("logs", "trainer").stdout,
            "the trainer resuming from its checkpoint",
            240,
            poll_s=0.5,
        )
    )
    say(f"trainer restarted at step {at_restart} and resumed from its checkpoint")

    run = wait_until(
        lambda: r if (r := client.run(run_id))["state"] in FINAL else None,
        "the run's end",
        900,
        poll_s=0.5,
    )
    summary["state"] = run["state"]
    summary["steps"] = run["step"]
    rewards = [row["reward_mean"] for row in client.metrics(run_id) if "reward_mean" in row]
    k = min(5, len(rewards) // 2) or 1
    summary["reward_first"] = round(sum(rewards[:k]) / k, 3) if rewards else None
    summary["reward_last"] = round(sum(rewards[-k:]) / k, 3) if rewards else None
    audit = audit_run(stack.reader_url, run_id, RunSpec.model_validate(spec), steps=run["step"])
    summary["lost"] = audit["lost"]
    summary["duplicated"] = audit["duplicated"]


def run_scenario(work: Path, steps: int = STEPS) -> dict:
    summary: dict = {}
    t0 = time.monotonic()
    engine = DockerEngine()
    engine.start()
    say(f"dockerd up ({engine.host})")
    model = build_beside("embedded")  # pre-trained while the image builds
    try:
        summary["build_s"] = round(engine.build_images(timeout_s=1200), 1)
        say(f"image built in {summary['build_s']} s")
        stack = Stack(engine, work)
        t_model = time.monotonic()
        model.result()
        summary["model_wait_s"] = round(time.monotonic() - t_model, 1)
        try:
            drive(stack, steps, summary)
        except BaseException:
            say(
                "failed; the services' last log lines:\n"
                + stack.compose("logs", "--tail", "25", check=False).stdout[-6000:]
            )
            raise
        finally:
            stack.compose("down", "-v", "--remove-orphans", "-t", "10", check=False)
            summary["leftovers"] = stack.leftovers()
            stack.client.close()
    finally:
        engine.stop()
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    return summary


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="spotrl-compose-") as tmp:
        print(json.dumps(run_scenario(Path(tmp))), flush=True)
