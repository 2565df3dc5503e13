"""A whole spotrl deployment as local processes: Redis, weight store(s), coordinator, trainer
and rollout workers; what `spotrl up` and `spotrl chaos` run. It stops everything it started,
and if the process that runs it dies instead (SIGKILL, the OOM killer), everything dies with it
(`procs.start`), Redis and each service's own children included.

Each service gets its settings as environment variables rendered from its settings class
(`settings_env`), so a name here is checked against the class the service reads it with. The
tests and benchmarks drive it through `tests.harness.deploy`, which adds what only they do
(restarting a service or Redis in place); nothing here is test-only.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from services.cli import procs
from services.cli.certs import make_certs
from services.cli.credentials import Credentials, tls_env
from services.coordinator.settings import CoordinatorSettings
from services.infra import redis_users
from services.infra.settings import CommonSettings, env_name, settings_env
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from services.weightstore.settings import WeightStoreSettings


@dataclass
class DeploymentConfig:
    work_dir: Path
    reserved: int = 1
    preemptible: int = 1
    api_token: str | None = None
    coordinator_port: int | None = None  # None: a free port
    redis_url: str | None = None  # use this Redis instead of starting one
    weightstores: int = 1  # weight-store replicas, each with its own folder
    worker_slots: int = 64
    engine: str = "hf"  # rollout backend: hf or vllm
    flush_tokens: int = 4
    trainer_threads: int = 1
    # trainers in the pool: "trainer", then "trainer-2", ...; several runs share the fleet
    # when the coordinator's max_active_runs is set too (SPOTRL_MAX_ACTIVE_RUNS in extra_env)
    trainers: int = 1
    trainer_ranks: int | None = None  # N ranks (torchrun, FSDP2); None: SPOTRL_TRAINER_RANKS
    worker_threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)  # for every service
    worker_env: dict[str, str] = field(default_factory=dict)  # for the rollout workers only
    redis_appendonly: bool = False  # the append-only file, as compose runs it
    redis_maxmemory_mb: int = 1024  # Redis refuses writes past this (noeviction); 0: no limit
    dump_rollouts: bool = True  # the trainer writes each step's groups to work_dir/rollouts
    reward_modules: list[str] = field(default_factory=list)  # the coordinator's allow list
    # least privilege (services.cli.credentials): a Redis user per role and per worker, a token
    # per scope (reads stay open: SPOTRL_PROTECT_READS); `api_token` is then the admin token
    secure: bool = False
    tls: bool = False  # every hop over TLS: a throwaway CA and certificate (services.cli.certs)


class LocalDeployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.work_dir = Path(config.work_dir).resolve()
        self.log_dir = self.work_dir / "logs"
        self.procs: dict[str, procs.Proc] = {}
        self.launch: dict[str, tuple[str, dict[str, str], int]] = {}  # name -> module, env, port
        self.redis_url = config.redis_url or ""
        self.coordinator_url = ""
        self.weightstore_url = ""
        self.trainer_url = ""
        self._workers = 0
        self.credentials = Credentials.make(config.api_token) if config.secure else None
        self.tls = make_certs(self.work_dir / "tls") if config.tls else None

    @property
    def admin_token(self) -> str | None:
        """What a client (the CLI, a test) sends to submit and cancel runs."""
        return self.credentials.admin_token if self.credentials else self.config.api_token

    @property
    def ca_file(self) -> Path | None:
        """The CA a client checks the services' certificates against (None: plain HTTP)."""
        return self.tls.ca if self.tls else None

    @property
    def reader_redis_url(self) -> str:
        """Redis as the read-only role (audits, the CLI's status); the open URL without users."""
        if self.credentials is None:
            return self.redis_url
        return self.credentials.redis_url(self.redis_url, "reader")

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def security_env(self, service: str) -> dict[str, str]:
        """`service`'s Redis user, tokens and certificate; {} in an open deployment."""
        env = self.credentials.service_env(service, self.redis_url) if self.credentials else {}
        return env | (tls_env(self.tls) if self.tls else {})

    def base_env(self) -> dict[str, str]:
        """The settings every service shares (CommonSettings), then `extra_env`."""
        env = settings_env(
            CommonSettings,
            redis_url=self.redis_url,
            coordinator_url=self.coordinator_url,
            weightstore_url=self.weightstore_url,
            api_token=None if self.credentials else self.config.api_token or None,
        )
        return env | self.config.extra_env

    @property
    def rollouts_dir(self) -> Path:
        """Where the trainer dumps each run's trained groups (with `dump_rollouts`)."""
        return self.work_dir / "rollouts"

    def attach(self, coordinator_url: str, weightstore_url: str) -> None:
        """Use services that run elsewhere (the redis URL comes from the config)."""
        self.coordinator_url, self.weightstore_url = coordinator_url, weightstore_url

    def start(
        self, timeout_s: float = 180.0, on_ready: Callable[[procs.Proc], None] | None = None
    ) -> None:
        """Start everything and wait until each answers /healthz (`on_ready` is called for each
        process as it does)."""
        try:
            self._start(timeout_s, on_ready)
        except BaseException:
            self.stop()
            raise

    def _service(self, name: str, module: str, env: dict[str, str], port: int) -> procs.Proc:
        self.launch[name] = (module, env, port)
        self.procs[name] = procs.start_service(
            name, module, env, self.log_dir, port, self.scheme, self.ca_file
        )
        return self.procs[name]

    def start_redis(self, port: int | None = None) -> procs.Proc:
        """This deployment's Redis (on `port`: a restart), with the ACL file and TLS it needs."""
        aclfile = None
        if self.credentials:  # kept over a restart: it holds the users minted for workers
            aclfile = self.work_dir / "redis-users.acl"
            if not aclfile.exists():
                major = redis_users.binary_major(procs.redis_server_binary())
                self.credentials.write_acl_file(aclfile, major)
        proc, url = procs.start_redis(
            self.log_dir,
            self.work_dir / "redis",
            port,
            appendonly=self.config.redis_appendonly,
            maxmemory_mb=self.config.redis_maxmemory_mb,
            aclfile=aclfile,
            tls=self.tls,
        )
        self.procs["redis"] = proc
        self.redis_url = url
        return proc

    def _start(self, timeout_s: float, on_ready: Callable[[procs.Proc], None] | None) -> None:
        if self.credentials:  # for the CLI beside it (`spotrl status`, `spotrl cancel`)
            write_secret(self.work_dir / "admin-token", self.credentials.admin_token)
        if not self.redis_url:
            self.start_redis()
        ws_ports = [procs.free_port() for _ in range(self.config.weightstores)]
        co_port = self.config.coordinator_port or procs.free_port()
        tr_ports = [procs.free_port() for _ in range(self.config.trainers)]
        tr_port = tr_ports[0]
        local = f"{self.scheme}://127.0.0.1"
        self.weightstore_url = ",".join(f"{local}:{p}" for p in ws_ports)
        self.coordinator_url = f"{local}:{co_port}"
        self.trainer_url = f"{local}:{tr_port}"
        env = self.base_env()
        for i, port in enumerate(ws_ports):  # replicas with their own disks
            name = "weightstore" if i == 0 else f"weightstore-{i + 1}"
            root = self.work_dir / ("weights" if i == 0 else f"weights-{i + 1}")
            ws_env = settings_env(WeightStoreSettings, port=port, root=root)
            ws_env |= self.security_env("weightstore")
            self._service(name, "services.weightstore.main", env | ws_env, port)
        co_env = settings_env(
            CoordinatorSettings,
            port=co_port,
            reward_modules=",".join(self.config.reward_modules) or None,
        )
        co_env |= self.security_env("coordinator")
        self._service("coordinator", "services.coordinator.main", env | co_env, co_port)
        for i, port in enumerate(tr_ports):  # one folder: a run's checkpoints are found by any
            name = "trainer" if i == 0 else f"trainer-{i + 1}"
            tr_env = settings_env(
                TrainerSettings,
                port=port,
                trainer_id=name,
                work_dir=self.work_dir / "trainer",
                rollouts_dir=self.rollouts_dir if self.config.dump_rollouts else None,
                trainer_ranks=self.config.trainer_ranks,
            )
            self._service(
                name,
                "services.trainer.main",
                env
                | procs.thread_env(self.config.trainer_threads)
                | tr_env
                | self.security_env("trainer"),
                port,
            )
        for _ in range(self.config.reserved):
            self.add_worker("reserved", wait=False)
        for _ in range(self.config.preemptible):
            self.add_worker("preemptible", wait=False)
        procs.wait_healthy(list(self.procs.values()), timeout_s, on_ready)

    def add_worker(self, pool: str, wait: bool = True, **settings: str) -> procs.Proc:
        self._workers += 1
        name = f"rollout-{pool}-{self._workers}"
        port = procs.free_port()
        env = (
            self.base_env()
            | procs.thread_env(self.config.worker_threads)
            | settings_env(
                RolloutSettings,
                port=port,
                pool=pool,
                worker_id=name,
                slots=self.config.worker_slots,
                engine=self.config.engine,
                flush_tokens=self.config.flush_tokens,
                cache_dir=self.work_dir / "rollout",
                advertise_url=f"{self.scheme}://127.0.0.1:{port}",
            )
            | self.security_env("rollout")
            | self.config.worker_env
            | settings_env(RolloutSettings, **settings)
        )
        proc = self._service(name, "services.rollout.main", env, port)
        if wait:
            procs.wait_healthy([proc])
        return proc

    def replace_worker(self, name: str) -> procs.Proc:
        """Start a new worker, under a new name, in the place of `name` (same pool and settings);
        forget the old one, which must have exited. A new name is a new consumer: the jobs the
        old one held are reclaimed by the coordinator when its heartbeat expires."""
        if self.procs[name].alive():
            raise RuntimeError(f"{name} is still running")
        del self.procs[name]
        module, env, _ = self.launch.pop(name)
        self._workers += 1
        new_name = f"rollout-{env[env_name(RolloutSettings, 'pool')]}-{self._workers}"
        port = procs.free_port()
        env = env | settings_env(
            RolloutSettings,
            port=port,
            worker_id=new_name,
            advertise_url=f"{self.scheme}://127.0.0.1:{port}",
        )
        return self._service(new_name, module, env, port)

    def workers(self) -> list[procs.Proc]:
        # a copy first: the chaos thread and the supervisor add and replace workers
        return [p for p in list(self.procs.values()) if p.name.startswith("rollout-")]

    def check_alive(self) -> None:
        """Raise if a core service died (workers are preemptible: they may come and go)."""
        for p in self.procs.values():
            if not p.name.startswith("rollout-") and not p.alive():
                raise procs.died(p)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop workers first, then the services, then Redis."""
        order = sorted(
            self.procs.values(),
            key=lambda p: 0 if p.name.startswith("rollout") else 2 if p.name == "redis" else 1,
        )
        for p in order:
            p.stop()


def write_secret(path: Path, text: str) -> None:
    """`text` in a file only its owner may read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
