"""The limits an environment process puts on itself before it imports any environment code: an
address-space limit (RLIMIT_AS) and no network (a network namespace of its own, with no
interface up, not even loopback).

The network namespace comes from `unshare(CLONE_NEWNET)`, which needs CAP_SYS_ADMIN (root in a
container); without it, a user namespace in the same call (`CLONE_NEWUSER | CLONE_NEWNET`) gives
one to an unprivileged user where the kernel allows user namespaces. Both must be called while
the process has a single thread. What this does not do: limit CPU, files or syscalls.

A process of user code (an environment's, a reward's) starts with its parent's environment less
spotrl's own variables (`user_code_environ`): every credential of a service (its Redis URL with
a password, the tokens it sends) is a `SPOTRL_*` variable, or Redis's REDISCLI_AUTH. Code that
the model's output drives never holds them, network or not; the user's own variables (an API key
its tool needs) stay.
"""

import contextlib
import ctypes
import os
import resource
from collections.abc import Callable, Mapping

CREDENTIAL_PREFIXES = ("SPOTRL_", "REDISCLI_AUTH")
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
Unshare = Callable[[int], int | None]  # unshare(flags): raises OSError when refused


def libc_unshare(flags: int) -> None:
    """unshare(2) through the C library; OSError with the errno when it is refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "unshare"):
        raise OSError(0, "the C library has no unshare()")
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _map_own_ids(uid: int, gid: int) -> None:
    """In a new user namespace, keep the uid and gid this process had (they show as nobody
    until mapped); best effort: the network namespace is what matters."""
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def isolate_network(unshare: Unshare = libc_unshare) -> str | None:
    """Move this process into a network namespace of its own. None when done; otherwise why
    neither way was allowed."""
    try:
        unshare(CLONE_NEWNET)
        return None
    except OSError as exc:
        alone = exc.strerror or str(exc)
    try:
        uid, gid = os.getuid(), os.getgid()
        unshare(CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as exc:
        return (
            f"unshare(CLONE_NEWNET) was refused ({alone}) and so was "
            f"unshare(CLONE_NEWUSER | CLONE_NEWNET) ({exc.strerror or exc})"
        )
    _map_own_ids(uid, gid)
    return None


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space at `max_bytes` (never above a hard limit already set),
    soft and hard alike, so its code cannot raise it again: an allocation past it fails
    (MemoryError in Python)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def user_code_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a process of user code starts with: `environ` (this process's by
    default) less spotrl's own variables, its credentials among them."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(CREDENTIAL_PREFIXES)}
