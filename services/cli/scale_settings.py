"""The settings of `spotrl scale` (`services.cli.scale`): the coordinator and run to follow,
bounds and cooldowns, and the engine target with its names. Validated like every setting (a bad
bound is an error that names it); the CLI flags map onto these fields one to one."""

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.cli.scale_decision import MAX_REPLICAS, ScalePolicy, WhenUnknown

if TYPE_CHECKING:
    from services.cli.scale_targets import ReplicaTarget


class ScaleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Coordinator base URL.")
    run_id: str | None = Field(
        None, description="Run to follow; None: every active run (the coordinator's /v1/fleet)."
    )
    target: Literal["k8s", "swarm", "compose"] = Field(description="Engine running the pool.")
    min_replicas: int = Field(
        0, ge=0, le=MAX_REPLICAS, description="Fewest replicas held; what is held with no run."
    )
    max_replicas: int = Field(ge=0, le=MAX_REPLICAS, description="Most replicas held.")
    interval_s: float = Field(15.0, gt=0, le=3600, description="Seconds between decisions.")
    up_cooldown_s: float = Field(
        60.0, ge=0, le=86400, description="After a change, wait this long before scaling up."
    )
    down_cooldown_s: float = Field(
        300.0, ge=0, le=86400, description="After a change, wait this long before scaling down."
    )
    when_unknown: WhenUnknown = Field(
        "hold",
        description="No figure yet (null or 0): keep the replicas found (hold) or go to the "
        "upper bound (max: every instance allowed).",
    )
    dry_run: bool = Field(False, description="Decide and log; change nothing.")
    once: bool = Field(False, description="One decision, then exit.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics on 127.0.0.1:PORT."
    )
    namespace: str = Field("default", max_length=253, description="k8s: the namespace.")
    deployment: str | None = Field(None, max_length=253, description="k8s: the Deployment.")
    kubeconfig: str | None = Field(
        None, description="k8s: kubeconfig path (None: in-cluster, else $KUBECONFIG)."
    )
    context: str | None = Field(None, description="k8s: kubeconfig context (None: current).")
    service: str | None = Field(None, max_length=253, description="swarm/compose: the service.")
    compose_project: str | None = Field(None, description="compose: the project name.")
    compose_files: list[str] = Field(default_factory=list, description="compose: its files.")

    @model_validator(mode="after")
    def _check(self) -> "ScaleSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"--min {self.min_replicas} > --max {self.max_replicas}")
        if self.target == "k8s" and not self.deployment:
            raise ValueError("--target k8s needs --deployment")
        if self.target in ("swarm", "compose") and not self.service:
            raise ValueError(f"--target {self.target} needs --service")
        return self

    def policy(self) -> ScalePolicy:
        return ScalePolicy(
            self.min_replicas,
            self.max_replicas,
            self.up_cooldown_s,
            self.down_cooldown_s,
            self.when_unknown,
        )

    def build_target(self) -> "ReplicaTarget":
        from services.cli import scale_targets as targets

        if self.target == "k8s":
            assert self.deployment is not None
            return targets.KubernetesDeployment(
                self.namespace, self.deployment, self.kubeconfig, self.context
            )
        assert self.service is not None
        if self.target == "swarm":
            return targets.SwarmService(self.service)
        return targets.ComposeService(self.service, self.compose_project, self.compose_files)
