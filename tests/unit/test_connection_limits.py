"""The connection rules (services.infra.connection_limits), on a clock of their own: the header
and body times, a body's time growing with its bytes, time the server held the client back not
counted, and the per-client cap with its exempt networks."""

import pytest

from services.infra.connection_limits import (
    HELD_POLL_S,
    ClientCounts,
    ConnectionLimits,
    Phase,
    RequestClock,
    parse_networks,
)

LIMITS = ConnectionLimits(
    header_timeout_s=10.0, body_timeout_s=30.0, body_min_bytes_per_s=1000.0, per_client=2
)


def test_headers_get_their_time_and_not_a_moment_more():
    clock = RequestClock(LIMITS)
    clock.enter(Phase.HEADERS, 100.0)
    assert clock.deadline() == 110.0
    assert clock.due(109.9, reading=True) == 110.0
    assert clock.due(110.0, reading=True) is None
    clock.received = 10**9  # bytes do not buy headers time
    assert clock.due(110.0, reading=True) is None


def test_a_body_gets_its_fixed_time_plus_its_bytes_at_the_least_rate():
    clock = RequestClock(LIMITS)
    clock.enter(Phase.BODY, 0.0)
    assert clock.due(29.0, reading=True) == 30.0
    clock.received = 5000  # five seconds' worth at 1000 B/s
    assert clock.due(30.0, reading=True) == 35.0
    assert clock.due(35.0, reading=True) is None


def test_a_trickle_is_cut_off_soon_after_the_fixed_time_whatever_its_length():
    clock = RequestClock(LIMITS)
    clock.enter(Phase.BODY, 0.0)
    clock.received = 30  # a byte a second for 30 s: 0.03 s more
    assert clock.due(30.03, reading=True) is None


def test_time_the_server_held_the_client_back_is_not_the_clients():
    clock = RequestClock(LIMITS)
    clock.enter(Phase.HEADERS, 0.0)
    assert clock.due(10.0, reading=False) == 10.0 + HELD_POLL_S  # paused: look again later
    assert clock.held_s == 10.0
    assert clock.due(11.0, reading=True) == 20.0  # reading again: 10 s held, 10 s its own
    assert clock.due(20.0, reading=True) is None


def test_a_new_phase_starts_afresh_and_no_phase_owes_nothing():
    clock = RequestClock(LIMITS)
    clock.enter(Phase.BODY, 0.0)
    clock.received, clock.held_s = 100, 5.0
    clock.enter(Phase.HEADERS, 50.0)
    assert (clock.received, clock.held_s, clock.deadline()) == (0, 0.0, 60.0)
    clock.enter(None, 60.0)
    assert clock.due(10**9, reading=True) == float("inf")


def test_an_address_past_its_cap_is_refused_until_it_closes_one():
    counts = ClientCounts(ConnectionLimits(per_client=2, uncapped=()))
    assert counts.admit("10.0.0.1") and counts.admit("10.0.0.1")
    assert not counts.admit("10.0.0.1")
    assert counts.admit("10.0.0.2")  # another address
    counts.release("10.0.0.1")
    assert counts.admit("10.0.0.1")
    for _ in range(2):
        counts.release("10.0.0.1")
    counts.release("10.0.0.2")
    assert counts.open == {}  # nothing kept of an address with no connection


def test_loopback_is_uncapped_by_default_and_a_listed_network_too():
    counts = ClientCounts(ConnectionLimits(per_client=1))
    assert all(counts.admit("127.0.0.1") for _ in range(5))
    assert all(counts.admit("::1") for _ in range(5))
    assert counts.admit("192.0.2.7") and not counts.admit("192.0.2.7")
    proxy = ConnectionLimits(per_client=1, uncapped=parse_networks("192.0.2.0/24, 2001:db8::1"))
    assert not proxy.capped("192.0.2.7") and not proxy.capped("2001:db8::1")
    assert proxy.capped("127.0.0.1") and proxy.capped("2001:db8::2")


def test_an_ipv4_client_of_a_dual_stack_socket_is_judged_by_its_ipv4_address():
    limits = ConnectionLimits(uncapped=parse_networks("10.0.0.0/8"))
    assert not limits.capped("::ffff:10.1.2.3")
    assert limits.capped("::ffff:11.1.2.3")
    assert not limits.capped("")  # a Unix socket: no address to count


def test_a_network_list_that_does_not_parse_names_the_entry():
    assert parse_networks(" , ") == ()
    with pytest.raises(ValueError, match="'10.0.0.300'"):
        parse_networks("127.0.0.1, 10.0.0.300")
