"""``kvfleet up --config FILE``: the file's values are defaults, flags given win, and a key that
is no flag or a value of the wrong kind is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet_cli.cli import parse_args
from kvfleet_cli.config_file import ConfigError, dump_yaml, load

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"nodes": 2, "block_size": 16, "model": None, "kv_cache_memory": 1 << 26, "verbose": False, "ratio": 0.5}


def test_yaml_and_toml_give_the_same_values(tmp_path):
    (tmp_path / "a.yaml").write_text("block_size: 256\nnodes: 3\nmodel: models/x\nratio: 1\n")
    (tmp_path / "a.toml").write_text('block-size = 256\nnodes = 3\nmodel = "models/x"\nratio = 1\n')
    want = {"block_size": 256, "nodes": 3, "model": "models/x", "ratio": 1}
    assert load(tmp_path / "a.yaml", FLAGS) == want == load(tmp_path / "a.toml", FLAGS)


@pytest.mark.parametrize("text, words", [
    ("block_sise: 256\n", "unknown key 'block_sise'"),
    ("block_size: big\n", "block_size must be an integer"),
    ("nodes: true\n", "nodes must be an integer"),
    ("verbose: 1\n", "verbose must be true or false"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("block_size: [\n", "not valid YAML"),
])
def test_bad_files_are_refused_by_name(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load(path, FLAGS)


def test_dump_reads_back(tmp_path):
    path = tmp_path / "out.yaml"
    path.write_text(dump_yaml({"block_size": 128, "model": "m"}, "written by a test\n\nsecond line"))
    assert path.read_text().startswith("# written by a test\n#\n# second line\n")
    assert load(path, FLAGS) == {"block_size": 128, "model": "m"}


def test_up_takes_the_file_as_defaults_and_flags_win(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("block_size: 256\nnodes: 3\n")
    args = parse_args(["up", "--config", str(path)])
    assert (args.block_size, args.nodes, args.kv_cache_memory) == (256, 3, 64 << 20)
    args = parse_args(["up", "--block-size", "16", "--config", str(path), "--nodes", "1"])
    assert (args.block_size, args.nodes) == (16, 1)  # even a flag equal to the default wins


def test_up_refuses_a_bad_file_in_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("block_size: 256\nnodez: 3\n")
    done = subprocess.run([sys.executable, "-m", "kvfleet_cli", "up", "--config", str(path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"kvfleet up: {path}: unknown key 'nodez'; known: ")
    assert "block_size" in line.split("known: ")[1].split(", ")
