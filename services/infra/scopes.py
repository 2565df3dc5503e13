"""Scoped API tokens: which token a service accepts, with which scope, and whether a scope may
use a route. Pure: no HTTP here (`service.Auth` and `http_limits.InputGuard` apply it).

A token grants one scope: "admin" (runs, workers: everything), "worker" (register), "trainer"
(upload and commit weights), "read" (GETs). The admin scope passes every check. A service
accepts `api_token` as admin, and the tokens of `accept_tokens` by their SHA-256, so that the
environment of a service that checks a token never holds the token itself.

It does not say which route needs which scope: each route declares that where it is defined.
"""

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast, get_args

Scope = Literal["admin", "worker", "trainer", "read"]
SCOPES: tuple[Scope, ...] = get_args(Scope)
DIGEST_HEX_CHARS = 64
OWNER_HEX_CHARS = 16  # of a token's digest: the run's owner (shown; never the token)


def token_digest(token: str) -> str:
    """The SHA-256 of a token, in hex: what `accept_tokens` lists."""
    return hashlib.sha256(token.encode()).hexdigest()


def as_scope(name: str) -> Scope:
    """`name` as a Scope; ValueError naming the scopes there are."""
    if name not in SCOPES:
        raise ValueError(f"unknown scope {name!r} (scopes: {', '.join(SCOPES)})")
    return cast(Scope, name)


def accept_list(tokens: Mapping[str, str]) -> str:
    """The `accept_tokens` setting that accepts these tokens (scope -> token), e.g.
    `accept_list({"worker": "w"}) == "worker:<sha256 of w>"`."""
    return ",".join(f"{as_scope(scope)}:{token_digest(token)}" for scope, token in tokens.items())


def parse_accept(setting: str | None) -> dict[str, Scope]:
    """`scope:sha256hex,...` as {digest: scope}. ValueError for an entry that is not a known
    scope and 64 hex digits, or a digest listed under two scopes; the message names the entry's
    place and never the digest (it is a setting's value)."""
    accepted: dict[str, Scope] = {}
    for place, entry in enumerate((setting or "").split(","), start=1):
        entry = entry.strip()
        if not entry:
            continue
        name, _, digest = entry.partition(":")
        scope = as_scope(name.strip())
        digest = digest.strip().lower()
        if len(digest) != DIGEST_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(
                f"entry {place} of the accepted tokens is not `scope:sha256hex` (the digest must "
                f"be {DIGEST_HEX_CHARS} hex digits: services.infra.scopes.token_digest)"
            )
        if accepted.get(digest, scope) != scope:
            raise ValueError(
                f"entry {place} of the accepted tokens repeats a token of another scope"
            )
        accepted[digest] = scope
    return accepted


def allows(granted: Scope, needed: frozenset[Scope]) -> bool:
    """Whether a token of scope `granted` may use a route that needs one of `needed`."""
    return granted == "admin" or granted in needed


def needs_text(needed: frozenset[Scope]) -> str:
    """`needed` in the order of SCOPES, for a message: 'admin', 'read, worker or trainer'."""
    names = [s for s in SCOPES if s in needed] or ["admin"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def refusal_text(granted: Scope, needed: frozenset[Scope]) -> str:
    """The short 403 detail for a valid token of the wrong scope."""
    return f"this token's scope ({granted}) may not do this (needs {needs_text(needed)})"


def bearer_of(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value; '' for any other."""
    scheme, _, given = authorization.partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


def owner_of(authorization: str) -> str:
    """Whom a write came from, for the per-token limits (`RunRecord.owner`): the first
    OWNER_HEX_CHARS hex digits of its bearer token's SHA-256; '' for a write without one."""
    token = bearer_of(authorization)
    return token_digest(token)[:OWNER_HEX_CHARS] if token else ""


@dataclass(frozen=True)
class Tokens:
    """The tokens one service accepts, {digest: scope}: its api_token as admin, and its
    accept_tokens. Empty: auth is off."""

    accepted: Mapping[str, Scope] = field(default_factory=dict)

    @classmethod
    def of(cls, api_token: str | None, accept_tokens: str | None) -> "Tokens":
        accepted = parse_accept(accept_tokens)
        if api_token:
            accepted[token_digest(api_token)] = "admin"
        return cls(accepted)

    @property
    def on(self) -> bool:
        """Whether any token is set: then every write needs one."""
        return bool(self.accepted)

    def scope_of(self, bearer: str) -> Scope | None:
        """The scope `bearer` grants here, None for no token or a token not accepted. Its digest
        is compared with every accepted one in constant time, and the loop does not stop at a
        match: the time taken says nothing of which token, if any, matched."""
        if not bearer:
            return None
        given = token_digest(bearer).encode()
        found: Scope | None = None
        for digest, scope in self.accepted.items():
            if hmac.compare_digest(given, digest.encode()) and found is None:
                found = scope
        return found
