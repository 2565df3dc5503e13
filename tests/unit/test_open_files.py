"""A server raises its soft limit on open files (`services.infra.service.raise_open_files_limit`,
run by `serve`): a thousand slow clients need more sockets than the usual 1,024, within what
the hard limit allows, and never lower than it was."""

import resource
import subprocess
import sys

import pytest

from services.infra.service import raise_open_files_limit


@pytest.fixture
def limits():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_soft_limit_rises_to_what_is_wanted_within_the_hard_limit(limits):
    _, hard = limits
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    got = raise_open_files_limit(want=4096)
    expected = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    assert got == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_a_hard_limit_below_the_wish_is_as_far_as_it_goes_and_says_so():
    # a hard limit lowered cannot be raised again: in a process of its own
    code = (
        "import logging; logging.basicConfig();"
        "from services.infra.service import raise_open_files_limit;"
        "print(raise_open_files_limit(want=4096))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "512"
    assert "open files limited to 512" in out.stderr


def test_a_soft_limit_above_the_wish_is_left_as_it_is(limits):
    _, hard = limits
    high = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (high, hard))
    assert raise_open_files_limit(want=1024) == high
