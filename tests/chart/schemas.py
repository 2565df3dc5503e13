"""Rendered objects against the schemas they will meet at install: each Kubernetes release's
strict schema (kubernetes-validate: unknown fields are errors, as the API server's strict field
validation makes them) and KEDA's ScaledObject CRD schema, made strict the same way.

Custom resources other than KEDA's (the PodMonitor, GKE's PodMonitoring, cert-manager's
Certificate and Issuer) have no schema here: the invariants check them."""

import functools
import json
from typing import Any

import jsonschema

OLDEST_KUBERNETES = "1.29"  # the chart's kubeVersion floor (Chart.yaml)
KEDA_KIND = ("keda.sh/v1alpha1", "ScaledObject")
# The custom resources the chart may render; any other kind must be in the release's schemas.
CUSTOM_KINDS = {
    KEDA_KIND,
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("monitoring.googleapis.com/v1", "PodMonitoring"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


def newest_kubernetes() -> str:
    from kubernetes_validate.utils import latest_version, major_minor

    return major_minor(latest_version())


def kubernetes_problem(obj: dict, version: str) -> str | None:
    """Why `obj` is invalid on this Kubernetes release (strict), None when it is valid. A known
    custom resource (CUSTOM_KINDS) is None: it has its own check; an unknown kind is invalid."""
    return _kubernetes_problem(json.dumps(obj, sort_keys=True), version)


@functools.cache
def _kubernetes_problem(obj_json: str, version: str) -> str | None:
    from kubernetes_validate import utils

    obj = json.loads(obj_json)
    try:
        utils.validate(obj, version, strict=True)
    except utils.SchemaNotFoundError:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            return None
        return f"{obj['apiVersion']} {obj['kind']} does not exist in Kubernetes {version}"
    except utils.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{obj['kind']}/{obj['metadata']['name']} on {version}: {where}: {exc.message}"
    return None


def _strict(node: Any) -> Any:
    """Every object with listed properties refuses the others (pydantic's schema allows them)."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def keda_validator() -> jsonschema.protocols.Validator:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    schema = _strict(ScaledObject.model_json_schema(by_alias=True))
    return jsonschema.Draft202012Validator(schema)


def keda_problems(obj: dict) -> list[str]:
    """Where a ScaledObject breaks KEDA's CRD schema (empty: nowhere)."""
    return [
        f"{'/'.join(str(p) for p in err.absolute_path)}: {err.message}"
        for err in keda_validator().iter_errors(obj)
    ]
