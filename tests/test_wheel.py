"""``pip install .`` gives a kvfleet that runs from site-packages, not only from its source folder.

The generated ``kvfleet.v1`` stubs are not committed (``protos/`` is their only source) and the CPU
kernels compile from ``kvfleet/kernels/csrc`` where they run: the wheel must carry both (setup.py's build
step, pyproject's package data). Built once here from a copy of the sources without any generated stub.

- Installed with --no-deps in a throwaway virtualenv (its dependencies borrowed from this one's
  site-packages) and imported from outside the source tree, beside Hugging Face's ``kernels`` and
  transformers, which it must not shadow.
- Installed alone, as a user would: a clean virtualenv, the CPU torch first, then the wheel with its
  dependencies from the registries at the versions CI tested (requirements-lock.txt as constraints),
  ``pip check``; then its own ``kvfleet up`` on the demo model, from a directory outside the checkout,
  answers through the OpenAI door and stops on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in ("bench", "tests"))
STUBS = [f"kvfleet/v1/{m}{suffix}" for m in ("inference", "compute", "block_manager")
         for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
KERNEL_SOURCES = sorted(p.name for p in (ROOT / "kvfleet" / "kernels" / "csrc").iterdir())

DEMO_MODEL = ROOT / "models" / "smollm2-135m-instruct"  # `make test` pulls it (kvfleet models pull smollm2)

PROBE = """
import json, importlib.resources
import kvfleet, kvfleet.v1.inference_pb2, kvfleet.v1.compute_pb2_grpc, kvfleet.v1.block_manager_pb2_grpc
import kvfleet.kernels, kvfleet.compute_service.model.causal_lm
import kernels, transformers.integrations.hub_kernels
csrc = importlib.resources.files("kvfleet.kernels") / "csrc"
print(json.dumps({"kvfleet": kvfleet.__file__, "csrc": str(csrc), "kernels": kernels.__file__,
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    src.mkdir()
    copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300)
    [built] = (tmp_path / "dist").glob("kvfleet-*.whl")
    return built


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
def test_the_wheel_carries_its_stubs_and_kernel_sources_and_runs_installed(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [s for s in STUBS if s not in names], "stubs missing from the wheel"
    assert not [k for k in KERNEL_SOURCES if f"kvfleet/kernels/csrc/{k}" not in names], "kernel sources missing"
    assert {f"{p}/__init__.py" for p in PACKAGES} <= names
    assert {name.split("/", 1)[0] for name in names if not name.startswith("kvfleet-")} == {"kvfleet"}, \
        "the wheel ships one top-level package"

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
    assert not found["kernels"].startswith(venv), found  # Hugging Face's kernels, from the borrowed site-packages
    assert found["sources"] == KERNEL_SOURCES
    assert (tmp_path / "venv" / "bin" / "kvfleet").is_file()  # the console script


def run_logged(argv: list, log: Path, timeout: float, **kw) -> None:
    with open(log, "a") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kw)
    assert done.returncode == 0, f"{argv[:4]} failed:\n" + log.read_text()[-4000:]


@pytest.mark.process
@pytest.mark.cluster
def test_the_wheel_alone_serves_through_the_openai_door_from_outside_the_checkout(wheel, tmp_path):
    assert (DEMO_MODEL / "config.json").is_file(), f"no demo model at {DEMO_MODEL} (make model pulls it)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVFLEET_ROUTER")}
    env["KVFLEET_STATE_FILE"] = str(tmp_path / "cluster.json")  # not the user's
    log = tmp_path / "install.log"
    run_logged([sys.executable, "-m", "venv", str(tmp_path / "venv")], log, 120, env=env)
    pip = [str(tmp_path / "venv" / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    run_logged([*pip, "install", "torch==2.13.0"], log, 600, env=env, cwd=tmp_path)
    run_logged([*pip, "install", "-c", str(ROOT / "requirements-lock.txt"), str(wheel)], log, 900, env=env, cwd=tmp_path)
    run_logged([*pip, "check"], log, 120, env=env, cwd=tmp_path)

    out = tmp_path / "up.out"
    with open(out, "w") as sink:
        up = subprocess.Popen([str(tmp_path / "venv" / "bin" / "kvfleet"), "up", "--nodes", "1", "--model",
                               str(DEMO_MODEL), "--work-dir", str(tmp_path / "work")], cwd=tmp_path, env=env,
                              stdout=sink, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, url = time.monotonic() + 300, None
        while url is None and time.monotonic() < deadline and up.poll() is None:
            url = (m := re.search(r"OpenAI-compatible HTTP API at (\S+)", out.read_text())) and m.group(1)
            time.sleep(0.5)
        assert url, "kvfleet up did not come up:\n" + out.read_text()[-4000:]
        client = openai.OpenAI(base_url=url, api_key="sk-gold", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=DEMO_MODEL.name, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "What is a KV cache?"}])
        choice = answer.choices[0]
        assert choice.message.content and choice.finish_reason in ("stop", "length"), answer
        assert answer.usage.completion_tokens > 0
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0, out.read_text()[-4000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "Traceback" not in out.read_text(), out.read_text()[-4000:]
