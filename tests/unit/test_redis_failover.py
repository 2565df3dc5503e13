"""services.infra.redis_failover, without a server: the redis+sentinel:// URL, and what a fence
does with a pool that has seen another primary."""

import asyncio

import pytest

from services.infra.redis_failover import FencedPool, RedisFailedOver, fenced, primary_of
from services.infra.redis_streams import connect
from services.infra.sentinel_url import SentinelUrl, parse_sentinel_url


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database():
    url = "redis+sentinel://spotrl-coordinator:p%40ss@s1:26379,[::1]:26380/spotrl/2"
    assert parse_sentinel_url(url) == SentinelUrl(
        (("s1", 26379), ("::1", 26380)), "spotrl", 2, "spotrl-coordinator", "p@ss", False
    )
    tls = parse_sentinel_url("rediss+sentinel://sentinel:26379/spotrl")
    assert tls == SentinelUrl((("sentinel", 26379),), "spotrl", 0, None, None, True)
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no service
        "redis+sentinel://s1:26379/spotrl/zero",
        "redis+sentinel://s1/spotrl",  # no port
        "redis+sentinel://user:secret@/spotrl",  # no sentinel
        "redis+sentinel://s1:26379/a/1/2",
    ],
)
def test_a_malformed_sentinel_url_is_refused_without_its_password(url):
    with pytest.raises(ValueError) as err:
        parse_sentinel_url(url)
    assert "secret" not in str(err.value)


def test_a_fenced_loop_is_refused_once_the_pool_saw_another_primary():
    async def go() -> None:
        r = connect("redis+sentinel://127.0.0.1:1/spotrl/0")
        pool = r.connection_pool
        assert isinstance(pool, FencedPool) and primary_of(r) is None
        pool.master_address = ("10.0.0.1", 6379)
        assert primary_of(r) == "10.0.0.1:6379"
        with fenced(r):
            pool.check_fence()  # the primary it was set under: fine
            pool.master_address, pool.epoch = ("10.0.0.2", 6379), pool.epoch + 1
            with pytest.raises(RedisFailedOver, match="10.0.0.2:6379"):
                pool.check_fence()
            with pytest.raises(RedisFailedOver):
                await r.get("k")  # refused before any connection is made
        pool.check_fence()  # unfenced code goes on
        with fenced(r):  # a loop started again: under the new primary
            pool.check_fence()
        await r.aclose()

    asyncio.run(go())
