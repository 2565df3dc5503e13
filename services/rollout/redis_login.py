"""Who a rollout worker is to Redis. Where the coordinator gives each worker its own Redis user
(`worker_redis_users`), the worker learns that user and its password only from its registration,
so no connection of its pool may log in before the registration answered: `RedisLogin` is the
pool's credential provider, and every new connection waits in it until the worker registered,
then logs in as the user the coordinator minted, or, where it minted none, as the worker's
SPOTRL_REDIS_URL says (exactly as without it). A worker registering again (its jobs task
restarted) is given a new password: connections opened from then on use it.

It does not register (the worker does, `presence.register`) and holds no connection itself.
"""

import asyncio
from typing import cast

import redis.asyncio as aioredis
from redis.credentials import CredentialProvider

from services.rollout.presence import Registration

Credentials = tuple[str] | tuple[str, str]


class NotRegistered(RuntimeError):
    """A Redis connection asked for its credentials synchronously before the registration."""


class RedisLogin(CredentialProvider):
    def __init__(self) -> None:
        self._configured: tuple[str, ...] = ()  # from the URL: (), (password,) or (user, password)
        self._credentials: tuple[str, ...] | None = None  # None until registered
        self._ready = asyncio.Event()

    def attach(self, r: aioredis.Redis) -> aioredis.Redis:
        """Make this the login of every connection `r`'s pool opens (none is open yet); the
        user and password of its URL become what it logs in as when none is minted."""
        kwargs = r.connection_pool.connection_kwargs
        username, password = kwargs.pop("username", None), kwargs.pop("password", None)
        if username:
            self._configured = (username, password or "")
        elif password:
            self._configured = (password,)
        kwargs["credential_provider"] = self
        return r

    @property
    def ready(self) -> bool:
        return self._credentials is not None

    def registered(self, answer: Registration) -> None:
        """The coordinator answered: log in as the user it minted, or as configured."""
        if answer.redis_username and answer.redis_password is not None:
            self._credentials = (answer.redis_username, answer.redis_password)
        else:
            self._credentials = self._configured
        self._ready.set()

    def as_configured(self) -> None:
        """No registration is coming (refused, or the worker is leaving before it registered):
        connections waiting, and those to come, log in as the URL says, as without this."""
        if self._credentials is None:
            self._credentials = self._configured
        self._ready.set()

    def get_credentials(self) -> Credentials:
        if self._credentials is None:
            raise NotRegistered("a Redis connection before the worker registered")
        return cast(Credentials, self._credentials)

    async def get_credentials_async(self) -> Credentials:
        # () logs in as nobody (redis-py sends no AUTH): a URL without user and password
        await self._ready.wait()
        return self.get_credentials()
