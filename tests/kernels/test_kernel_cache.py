"""The native kernels' cache survives a process killed while building: nothing it leaves behind
makes a later start wait."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from kvfleet.kernels import cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.process
def test_a_cached_library_loads_past_a_dead_builders_lock(tmp_path):
    assert cpu_kernels.load_extension(), "the native kernels build on this machine (make setup builds them)"
    name, flags = cpu_kernels.build_variants()[0]
    built = cpu_kernels.library_path(name, flags)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    # the cache as another process finds it: the library, and a build lock whose holder was killed
    code = ("import os, sys; from kvfleet.kernels import cpu_kernels as k; n, f = k.build_variants()[0]; "
            "print(k.library_path(n, f))")
    cached = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    shutil.copy(built, cached)
    for leftover in (os.path.join(os.path.dirname(cached), "lock"), str(tmp_path / ".building-dead" / "lock")):
        os.makedirs(os.path.dirname(leftover), exist_ok=True)
        open(leftover, "w").close()
    load = "import sys; from kvfleet.kernels import cpu_kernels as k; sys.exit(0 if k.load_extension() else 1)"
    done = subprocess.run([sys.executable, "-c", load], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.process
def test_processes_starting_together_on_a_new_machine_build_once(tmp_path):
    """Two nodes of `kvfleet up` on an empty cache: one compiles, the other waits on its lock and loads
    that library (before, both compiled on the same cores and the start took twice as long); the
    first is SIGKILLed while it builds, and the lock dies with it: the second then builds."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    load = "import sys; from kvfleet.kernels import cpu_kernels as k; sys.exit(0 if k.load_extension() else 1)"

    def start():
        return subprocess.Popen([sys.executable, "-c", load], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    killed = start()
    locks = lambda: list(tmp_path.glob("*.lock"))  # noqa: E731
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".building-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert locks(), "the first process builds under a lock"
    waiting, other = start(), start()
    time.sleep(1.0)
    killed.kill()
    killed.wait()
    errors = [p.communicate(timeout=300)[1] for p in (waiting, other)]
    assert waiting.returncode == 0 and other.returncode == 0, errors
    builds = sum(err.count("building the native CPU kernels") for err in errors)
    assert builds == 1, errors
