"""The README's "What is here" table is the map a newcomer reads first: every folder it names exists,
and every top-level folder of the repository and every package of kvfleet and every room of
kvfleet.compute_service is named there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def map_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## What is here", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def top_level_folders() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return {name.split("/", 1)[0] for name in listed.split("\0") if "/" in name and not name.startswith(".")}


def test_every_named_folder_exists():
    rows = map_rows()
    assert len(rows) >= 10
    missing = [row for row in rows if not (ROOT / row).is_dir()]
    assert not missing, f"README names folders that do not exist: {missing}"


def test_every_folder_is_named():
    named = {row.rstrip("/") for row in map_rows()}
    named_tops = {row.split("/", 1)[0] for row in named}
    assert top_level_folders() <= named_tops, f"not in the README's map: {top_level_folders() - named_tops}"
    parts = {f"kvfleet/{p.name}" for p in (ROOT / "kvfleet").iterdir() if (p / "__init__.py").is_file()}
    unnamed = sorted(p for p in parts if not any(row == p or row.startswith(f"{p}/") for row in named))
    assert not unnamed, f"packages of kvfleet not in the README's map (nor any room of theirs): {unnamed}"
    rooms = {f"kvfleet/compute_service/{p.name}" for p in (ROOT / "kvfleet" / "compute_service").iterdir()
             if (p / "__init__.py").is_file()}
    assert rooms <= named, f"compute_service rooms not in the README's map: {rooms - named}"
