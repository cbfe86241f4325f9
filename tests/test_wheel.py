"""``pip install .`` gives a kvfleet that runs from site-packages, not only from its source folder.

The generated ``kvfleet.v1`` stubs are not committed (``protos/`` is their only source) and the CPU
kernels compile from ``kvfleet/kernels/csrc`` where they run: the wheel must carry both (setup.py's build
step, pyproject's package data). Built here from a copy of the sources without any generated stub,
then installed with --no-deps in a throwaway virtualenv (its dependencies borrowed from this one's
site-packages), and imported from outside the source tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in ("bench", "tests"))
STUBS = [f"kvfleet/v1/{m}{suffix}" for m in ("inference", "compute", "block_manager")
         for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
KERNEL_SOURCES = sorted(p.name for p in (ROOT / "kvfleet" / "kernels" / "csrc").iterdir())

PROBE = """
import json, importlib.resources
import kvfleet, kvfleet.v1.inference_pb2, kvfleet.v1.compute_pb2_grpc, kvfleet.v1.block_manager_pb2_grpc
csrc = importlib.resources.files("kvfleet.kernels") / "csrc"
print(json.dumps({"kvfleet": kvfleet.__file__, "csrc": str(csrc),
                  "sources": sorted(p.name for p in csrc.iterdir())}))
"""


def copy_sources(dest: Path) -> None:
    """What the image's build context holds, less anything generated or cached."""
    def ignore(folder: str, names: list[str]) -> list[str]:
        generated = ["v1"] if Path(folder) == ROOT / "kvfleet" else []  # the stubs: the build makes them
        return [n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info")) or n in generated]

    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("protos", *PACKAGES):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    assert not (dest / "kvfleet" / "v1").exists()


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("kvfleet-*.whl")
    return wheel


def throwaway_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    # a .pth in site-packages appends these after the venv's own: kvfleet itself comes from the venv
    # (an editable install's finder there is not loaded: .pth files of appended paths are not read)
    borrowed = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "borrowed-dependencies.pth").write_text("\n".join(borrowed) + "\n")
    return python


@pytest.mark.process
def test_the_wheel_carries_its_stubs_and_kernel_sources_and_runs_installed(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [s for s in STUBS if s not in names], "stubs missing from the wheel"
    assert not [k for k in KERNEL_SOURCES if f"kvfleet/kernels/csrc/{k}" not in names], "kernel sources missing"
    assert {f"{p}/__init__.py" for p in PACKAGES} <= names

    python = throwaway_venv(tmp_path / "venv")
    # nothing from the source tree: with it on PYTHONPATH, pip finds kvfleet's egg-info there, calls
    # the wheel "already installed" and installs nothing
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300, env=env)
    probe = subprocess.run([python, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    venv = str(tmp_path / "venv")
    assert found["kvfleet"].startswith(venv) and found["csrc"].startswith(venv), found
    assert found["sources"] == KERNEL_SOURCES
    assert (tmp_path / "venv" / "bin" / "kvfleet").is_file()  # the console script
