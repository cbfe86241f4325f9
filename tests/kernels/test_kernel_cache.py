"""The native kernels' cache survives a process killed while building: nothing it leaves behind
makes a later start wait."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kernels import cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.process
def test_a_cached_library_loads_past_a_dead_builders_lock(tmp_path):
    assert cpu_kernels.load_extension(), "the native kernels build on this machine (make setup builds them)"
    name, flags = cpu_kernels.build_variants()[0]
    built = cpu_kernels.library_path(name, flags)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    # the cache as another process finds it: the library, and a build lock whose holder was killed
    code = ("import os, sys; from kernels import cpu_kernels as k; n, f = k.build_variants()[0]; "
            "print(k.library_path(n, f))")
    cached = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    shutil.copy(built, cached)
    for leftover in (os.path.join(os.path.dirname(cached), "lock"), str(tmp_path / ".building-dead" / "lock")):
        os.makedirs(os.path.dirname(leftover), exist_ok=True)
        open(leftover, "w").close()
    load = "import sys; from kernels import cpu_kernels as k; sys.exit(0 if k.load_extension() else 1)"
    done = subprocess.run([sys.executable, "-c", load], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
