"""Scoped API tokens, the pure part: the accept list, which scope a token grants, which scope
passes which check, and the settings that carry them."""

import pytest
from pydantic import ValidationError

from services.infra.scopes import (
    Tokens,
    accept_list,
    allows,
    bearer_of,
    parse_accept,
    refusal_text,
    token_digest,
)
from services.infra.settings import CommonSettings

TOKENS = {"admin": "a-tok", "worker": "w-tok", "trainer": "t-tok", "read": "r-tok"}


def test_the_accept_list_holds_digests_not_tokens():
    setting = accept_list(TOKENS)
    assert all(token not in setting for token in TOKENS.values())
    assert parse_accept(setting) == {token_digest(t): s for s, t in TOKENS.items()}
    assert token_digest("w-tok") == token_digest("w-tok") != token_digest("w-tok ")
    assert parse_accept(None) == parse_accept("") == parse_accept(" , ") == {}
    # two tokens of one scope, spaces and capitals are fine
    two = f" worker:{token_digest('x').upper()} , worker:{token_digest('y')}"
    assert set(parse_accept(two).values()) == {"worker"}


@pytest.mark.parametrize(
    "setting, says",
    [
        ("boss:" + "0" * 64, "unknown scope 'boss'"),
        ("worker:" + "0" * 63, "entry 1"),
        ("read:" + "0" * 64 + ",worker:xyz", "entry 2"),
        ("worker", "entry 1"),
        ("read:" + "g" * 64, "entry 1"),
        (f"read:{'1' * 64},worker:{'1' * 64}", "another scope"),
    ],
)
def test_a_bad_entry_is_a_clear_error(setting, says):
    with pytest.raises(ValueError, match=says):
        parse_accept(setting)


def test_scope_of_a_bearer_token():
    tokens = Tokens.of("legacy-admin", accept_list(TOKENS))
    assert tokens.on and not Tokens().on and not Tokens.of(None, "").on
    assert tokens.scope_of("legacy-admin") == "admin"
    for scope, token in TOKENS.items():
        assert tokens.scope_of(token) == scope
    assert tokens.scope_of("") is None
    assert tokens.scope_of("nope") is None
    assert tokens.scope_of(token_digest("w-tok")) is None  # the digest is no token
    assert Tokens.of(None, accept_list({"worker": "w"})).scope_of("w") == "worker"


def test_admin_passes_every_check_and_other_scopes_only_their_own():
    assert allows("admin", frozenset({"worker"}))
    assert allows("worker", frozenset({"read", "worker", "trainer"}))
    assert not allows("worker", frozenset({"admin"}))
    assert not allows("read", frozenset({"trainer"}))
    assert (
        refusal_text("worker", frozenset({"admin"}))
        == "this token's scope (worker) may not do this (needs admin)"
    )
    assert refusal_text("admin", frozenset({"trainer", "worker", "read"})).endswith(
        "(needs worker, trainer or read)"
    )


def test_bearer_header():
    assert bearer_of("Bearer tok") == bearer_of("bearer  tok ") == "tok"
    assert bearer_of("Basic tok") == bearer_of("tok") == bearer_of("") == ""


def test_settings_carry_the_accept_list_and_the_token_sent(monkeypatch):
    for name in ("SPOTRL_API_TOKEN", "SPOTRL_TOKEN", "SPOTRL_ACCEPT_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    accepted = accept_list({"worker": "w"})
    # off loopback, an accept list alone is a token set
    s = CommonSettings(host="0.0.0.0", accept_tokens=accepted, token="w")
    assert s.outgoing_token() == "w" and s.api_token is None
    assert CommonSettings(api_token="adm").outgoing_token() == "adm"
    assert CommonSettings(api_token="adm", token="").outgoing_token() == "adm"
    assert CommonSettings().outgoing_token() is None
    monkeypatch.setenv("SPOTRL_ACCEPT_TOKENS", "worker:" + "z" * 64)
    with pytest.raises(ValidationError, match="entry 1 of the accepted tokens") as caught:
        CommonSettings()
    assert "z" * 64 not in str(caught.value)
