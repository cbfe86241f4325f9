"""Children started through ``kvfleet.core.parent_death`` die with their parent, with no ``preexec_fn``."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvfleet.core import parent_death

pytestmark = pytest.mark.process  # starts processes without a tier fixture (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts a wrapped program and a kvfleet-style child (``arm`` at startup), prints
# their pids, and waits to be killed; the kvfleet-style child says "armed" on the same output once
# it has armed.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from kvfleet.core import parent_death
    env = parent_death.child_env(os.environ)
    wrapped = subprocess.Popen(parent_death.wrap(["sleep", "600"]), env=env)
    armed = subprocess.Popen([sys.executable, "-c", "from kvfleet.core import parent_death; parent_death.arm(); "
                              "print('armed', flush=True); import time; time.sleep(600)"], env=env)
    print("pids", wrapped.pid, armed.pid, flush=True)
    time.sleep(600)
""")


def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def _lines(pipe, wanted: set[str], timeout_s: float = 60.0) -> dict[str, list[str]]:
    """The first line of each kind in ``wanted`` (its first word) → its other words, read from an
    unbuffered ``pipe`` as they come (so that a line never waits in a buffer that ``select`` cannot see)."""
    got: dict[str, list[str]] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted <= set(got):
        left = deadline - time.monotonic()
        assert left > 0 and select.select([pipe], [], [], left)[0], f"only {sorted(got)} within {timeout_s} s"
        line = pipe.readline().decode()
        assert line, f"the parent's output ended with only {sorted(got)}"
        word, *rest = line.split()
        got.setdefault(word, rest)
    return got


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_children_die_when_their_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, bufsize=0, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    children: list[int] = []
    try:
        said = _lines(parent.stdout, {"pids", "armed"})  # the kvfleet-style child has armed
        children = [int(pid) for pid in said["pids"]]
        assert len(children) == 2 and all(_alive(pid) for pid in children)
        # the wrapped one arms before its exec: once it runs sleep, it has armed
        _until(lambda: Path(f"/proc/{children[0]}/comm").read_text().strip() == "sleep", "the wrapped child runs sleep")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in children)
    finally:
        parent.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    # KVFLEET_PARENT_PID names a process that is not the child's parent: as if the parent had died
    # between the spawn and the child's prctl (the child would then have been re-parented).
    env = {**os.environ, "PYTHONPATH": str(ROOT), parent_death.ENV: "1"}
    done = subprocess.run(parent_death.wrap(["sleep", "600"]), env=env, timeout=60, cwd=ROOT)  # sleep 600 would time out
    assert done.returncode == 1


# A kvfleet-style child that arms, then prints the parent-death signal it holds (prctl
# PR_GET_PDEATHSIG = 2; 0 when none).
ARM_AND_REPORT = textwrap.dedent("""
    import ctypes
    from kvfleet.core import parent_death
    parent_death.arm()
    signal = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(signal))
    print(signal.value)
""")


def _arm_in_a_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ARM_AND_REPORT], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_arm_asks_for_sigterm_when_its_parent_is_named():
    done = _arm_in_a_child(parent_death.child_env(os.environ))
    assert (done.returncode, done.stdout.strip()) == (0, str(int(signal.SIGTERM))), done.stderr


def test_arm_is_a_no_op_without_a_named_parent():
    env = {k: v for k, v in os.environ.items() if k != parent_death.ENV}
    done = _arm_in_a_child(env)
    # it neither exited nor armed: no parent-death signal, the program ran to its end
    assert (done.returncode, done.stdout.strip()) == (0, "0"), done.stderr
