"""Every Python file of the project, tests and benchmarks included, stays under 400 lines: a file past
that holds more than one idea and is asking to be split (generated stubs are not tracked, so not read)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def test_the_listing_sees_the_project():
    names = {p.relative_to(ROOT).as_posix() for p in tracked_python_files()}
    assert "tests/test_file_sizes.py" in names and "kvfleet/compute_service/engine/llm_engine.py" in names


def test_no_python_file_is_over_400_lines():
    too_long = {}
    for path in tracked_python_files():
        with path.open("rb") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            too_long[path.relative_to(ROOT).as_posix()] = lines
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
