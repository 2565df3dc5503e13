"""A weight store's answers read as their contract types (services.weights.contract): an answer
that does not fit is a `WeightTransferError`, like any other failure to move a version."""

from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from services.infra.retry import brief
from services.weights.contract import Manifest, WeightTransferError

A = TypeVar("A", bound=BaseModel)


def parse_answer(cls: type[A], resp: httpx.Response, what: str) -> A:
    """A store's answer as its contract type; WeightTransferError when it does not fit."""
    try:
        return cls.model_validate_json(resp.content)
    except ValidationError as exc:
        raise WeightTransferError(f"{what}: malformed answer ({brief(exc)})") from exc


def read_manifest(resp: httpx.Response, what: str) -> Manifest:
    """The manifest a store answered with (200), else WeightTransferError."""
    if resp.status_code != 200:
        raise WeightTransferError(f"manifest of {what}: {resp.status_code} {resp.text}")
    return parse_answer(Manifest, resp, f"manifest of {what}")
