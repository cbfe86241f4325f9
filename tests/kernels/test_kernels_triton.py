"""Runs triton_cases.py under TRITON_INTERPRET=1 in a child process.

The interpreter replaces ``@triton.jit`` at decoration time, triton's own library included, so it must
be on before triton is first imported; a child process keeps it out of every other test.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_cases.py")


@pytest.mark.process
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVFLEET_TRITON_DEVICE": "cpu"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parents[2], env=env, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
