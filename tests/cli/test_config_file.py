"""``kvfleet up --config FILE``: the file's values are defaults, flags given win, and a key that
is no setting or a value its setting refuses is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfleet.cli.cli import parse_args
from kvfleet.cli.config_file import ConfigError, dump_yaml, load
from kvfleet.cli.up import UpSettings
from kvfleet.core.settings import build, check, setting

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Flags:
    nodes: int = setting(2, "nodes", at_least=1)
    block_size: int = setting(16, "tokens per block")
    model: str | None = setting(None, "model directory")
    kv_cache_memory: int = setting(1 << 26, "bytes")
    verbose: bool = setting(False, "say more")
    ratio: float = setting(0.5, "a share", at_most=1)

    def __post_init__(self) -> None:
        check(self)


def test_yaml_and_toml_give_the_same_values(tmp_path):
    (tmp_path / "a.yaml").write_text("block_size: 256\nnodes: 3\nmodel: models/x\nratio: 1\n")
    (tmp_path / "a.toml").write_text('block-size = 256\nnodes = 3\nmodel = "models/x"\nratio = 1\n')
    want = {"block_size": 256, "nodes": 3, "model": "models/x", "ratio": 1.0}
    assert load(tmp_path / "a.yaml", Flags) == want == load(tmp_path / "a.toml", Flags)


@pytest.mark.parametrize("text, words", [
    ("block_sise: 256\n", "unknown key 'block_sise'"),
    ("block_size: big\n", "--block-size must be an integer, got 'big'"),
    ("nodes: true\n", "--nodes must be an integer, got True"),
    ("nodes: 0\n", "--nodes must be at least 1, got 0"),
    ("ratio: 2\n", "--ratio must be at most 1, got 2"),
    ("verbose: 1\n", "--verbose must be true or false, got 1"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("block_size: [\n", "not valid YAML"),
])
def test_bad_files_are_refused_by_name(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load(path, Flags)


def test_dump_reads_back(tmp_path):
    path = tmp_path / "out.yaml"
    path.write_text(dump_yaml({"block_size": 128, "model": "m"}, "written by a test\n\nsecond line"))
    assert path.read_text().startswith("# written by a test\n#\n# second line\n")
    assert load(path, Flags) == {"block_size": 128, "model": "m"}


def up_settings(argv: list[str]) -> tuple[int, int, int]:
    """(nodes, block size, KV pool bytes) ``kvfleet up ARGV`` would start."""
    up = build(UpSettings, parse_args(["up", *argv]))
    return up.nodes, up.node.engine.block_size, up.node.engine.kv_cache_memory


def test_up_takes_the_file_as_defaults_and_flags_win(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("block_size: 256\nnodes: 3\n")
    assert up_settings(["--config", str(path)]) == (3, 256, 64 << 20)
    assert up_settings(["--block-size", "16", "--config", str(path), "--nodes", "1"])[:2] == (1, 16)  # even the default


@pytest.mark.process
def test_up_refuses_a_bad_file_in_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("block_size: 256\nnodez: 3\n")
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", "--config", str(path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"kvfleet up: {path}: unknown key 'nodez'; known: ")
    assert "block_size" in line.split("known: ")[1].split(", ")


def test_the_file_kvfleet_tune_writes_is_one_up_takes(tmp_path):
    from dataclasses import asdict

    from kvfleet.cli.loadgen.local import ClusterShape

    path = tmp_path / "kvfleet-tuned.yaml"
    path.write_text(dump_yaml(asdict(ClusterShape("models/x", nodes=2, block_size=128)), "written as kvfleet tune does"))
    assert load(path, UpSettings) == {"model": "models/x", "nodes": 2, "block_size": 128, "kv_cache_memory": 64 << 20,
                                      "kv_cache_dtype": "auto"}
