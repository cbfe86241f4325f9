"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``).

The child asks for the signal itself, after its exec, instead of through a ``preexec_fn``. A
``preexec_fn`` makes ``subprocess`` call fork() rather than vfork(), and fork() first runs every
``pthread_atfork`` handler in the parent. grpcio registers one that waits for the library's own
threads to settle; in a process with live gRPC channels or servers (a test, ``kvfleet up``) that
wait can last forever. CI saw it: a test hung inside ``Popen`` while starting etcd.

    parent:  Popen(wrap(argv) or a kvfleet command, env=child_env(env))   # no preexec_fn: vfork
    child:   arm()   # kvfleet commands at startup; other programs via ``python -m kvfleet.core.parent_death``

``arm`` also closes the window between the spawn and the ``prctl``: if the parent died in it, the
child's parent is no longer the one named in the environment, and it exits at once.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "KVFLEET_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """``env`` for a child that should die with this process."""
    return {**env, ENV: str(os.getpid())}


def wrap(argv: list[str]) -> list[str]:
    """A command line that runs ``argv`` as a child that dies with this process."""
    return [sys.executable, "-m", "kvfleet.core.parent_death", *argv]


def arm() -> None:
    """In a child started with ``child_env``: SIGTERM when that parent dies; exit now if it already
    has. A no-op elsewhere (and off Linux)."""
    parent = os.environ.pop(ENV, None)  # not inherited further: our own children have another parent
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != int(parent):
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m kvfleet.core.parent_death PROGRAM [ARG ...]")
    arm()
    os.execvp(sys.argv[1], sys.argv[1:])
