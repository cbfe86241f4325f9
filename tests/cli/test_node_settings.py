"""Every node setting is declared once (``kvfleet.compute_service.node.settings``) and reads the same from
``kvfleet compute``, ``kvfleet up``, a ``--config`` file and the local cluster's argv for its nodes:
same default (up's local ones aside), same type, same rule, the same words when a value breaks it.

The tables name every setting: a new one fails ``test_the_tables_name_every_node_setting`` until it
has a sample value (and a bad one, when it has a rule)."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import pytest

from kvfleet.cli import up as up_command
from kvfleet.cli.config_file import ConfigError, dump_yaml, load
from kvfleet.cli.local_nodes import LOCAL_NODE_DEFAULTS, node_command
from kvfleet.compute_service.node import main as compute_main
from kvfleet.compute_service.node.settings import NodeCommand, NodeSettings
from kvfleet.core.settings import SettingError, build, names, specs, to_argv
from tests.cli.test_first_contact import model, refused  # noqa: F401 - the fixture is used

DISK = str(Path(tempfile.gettempdir()) / "kvfleet-settings-test-kv")  # never created: only its parent is checked

# name -> (as typed on a command line, the value it means); all of them together are one valid node
SAMPLES = {
    "block_size": ("chat", 256), "kv_cache_memory": ("1048576", 1 << 20), "dtype": ("float32", "float32"),
    "kv_cache_dtype": ("bfloat16", "bfloat16"), "device": ("cuda:1", "cuda:1"), "max_num_seqs": ("8", 8),
    "max_num_batched_tokens": ("512", 512), "long_prefill_token_threshold": ("256", 256),
    "max_model_len": ("1024", 1024), "kv_layout": ("contiguous", "contiguous"),
    "kv_host_memory": ("1048576", 1 << 20), "kv_disk_dir": (DISK, DISK), "kv_disk_bytes": ("2097152", 2 << 20),
    "preemption_mode": ("swap", "swap"), "stream_interval": ("4", 4), "batch_wait_ms": ("0", 0.0),
    "p99_itl_target_ms": ("50", 50.0), "control_interval_s": ("1.5", 1.5), "drain_timeout": ("5", 5.0),
    "reconcile_interval": ("7", 7.0), "kv_snapshot_dir": ("snapshots", "snapshots"),
    "kv_snapshot_interval_s": ("0", 0.0), "kv_snapshot_blocks": ("64", 64), "warmup": ("random", "random"),
    "warmup_tokens": ("40", 40), "kv_fetch": ("always", "always"), "kv_fetch_min_blocks": ("4", 4),
    "kv_fetch_deadline_factor": ("3", 3.0), "kv_fetch_min_deadline_s": ("0.25", 0.25),
    "kv_fetch_max_deadline_s": ("9", 9.0),
}
# name -> (a value its rule refuses, the line that says so)
BAD = {
    "block_size": ("17", "--block-size must be a multiple of 16 in 16..2048, got 17"),
    "kv_cache_memory": ("0", "--kv-cache-memory must be at least 1, got 0"),
    "dtype": ("float64", "--dtype must be one of auto, float32, bfloat16, float16, got 'float64'"),
    "kv_cache_dtype": ("fp8", "--kv-cache-dtype must be one of auto, float32, bfloat16, float16, fp8_e4m3, got 'fp8'"),
    "max_num_seqs": ("0", "--max-num-seqs must be at least 1, got 0"),
    "max_num_batched_tokens": ("many", "--max-num-batched-tokens must be an integer, got 'many'"),
    "long_prefill_token_threshold": ("-1", "--long-prefill-token-threshold must be at least 0, got -1"),
    "max_model_len": ("0", "--max-model-len must be at least 1, got 0"),
    "kv_layout": ("ragged", "--kv-layout must be one of paged, contiguous, got 'ragged'"),
    "kv_host_memory": ("-1", "--kv-host-memory must be at least 0, got -1"),
    "kv_disk_bytes": ("1.5", "--kv-disk-bytes must be an integer, got '1.5'"),
    "preemption_mode": ("never", "--preemption-mode must be one of auto, swap, recompute, got 'never'"),
    "stream_interval": ("0", "--stream-interval must be at least 1, got 0"),
    "batch_wait_ms": ("-5", "--batch-wait-ms must be at least 0, got -5"),
    "p99_itl_target_ms": ("0", "--p99-itl-target-ms must be positive, got 0"),
    "control_interval_s": ("0", "--control-interval-s must be positive, got 0"),
    "drain_timeout": ("soon", "--drain-timeout must be a number, got 'soon'"),
    "reconcile_interval": ("0", "--reconcile-interval must be positive, got 0"),
    "kv_snapshot_interval_s": ("-1", "--kv-snapshot-interval-s must be at least 0, got -1"),
    "kv_snapshot_blocks": ("0", "--kv-snapshot-blocks must be at least 1, got 0"),
    "warmup": ("full", "--warmup must be one of minimal, random, got 'full'"),
    "warmup_tokens": ("0", "--warmup-tokens must be at least 1, got 0"),
    "kv_fetch": ("sometimes", "--kv-fetch must be one of auto, always, off, got 'sometimes'"),
    "kv_fetch_min_blocks": ("0", "--kv-fetch-min-blocks must be at least 1, got 0"),
    "kv_fetch_deadline_factor": ("0", "--kv-fetch-deadline-factor must be positive, got 0"),
    "kv_fetch_min_deadline_s": ("0", "--kv-fetch-min-deadline-s must be positive, got 0"),
    "kv_fetch_max_deadline_s": ("-1", "--kv-fetch-max-deadline-s must be positive, got -1"),
}
PLACE = ["--model", "m", "--node-id", "n0"]  # what `kvfleet compute` needs besides a node's settings


def parser_of(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


COMPUTE, UP = parser_of(compute_main.add_arguments), parser_of(up_command.add_arguments)


def flags(values: dict[str, str]) -> list[str]:
    return [part for name, text in values.items() for part in ("--" + name.replace("_", "-"), text)]


def from_compute(argv: list[str]) -> NodeSettings:
    return build(NodeCommand, COMPUTE.parse_args([*PLACE, *argv])).settings


def from_up(argv: list[str]) -> NodeSettings:
    return build(up_command.UpSettings, UP.parse_args(argv)).node


def from_config(path: Path, argv: list[str] = ()) -> NodeSettings:
    """As ``kvfleet.cli.cli`` reads ``up --config``: the file's values become the defaults."""
    parser = parser_of(up_command.add_arguments)
    parser.set_defaults(**load(path, up_command.UpSettings))
    return build(up_command.UpSettings, parser.parse_args(argv)).node


def test_the_tables_name_every_node_setting():
    assert set(SAMPLES) == set(names(NodeSettings))
    ruled = {s.name for s in specs(NodeSettings) if s.kind is not str or s.rule.choices or s.rule.parse}
    assert ruled == set(BAD)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_one_default_for_compute_and_up(name):
    [spec] = [s for s in specs(NodeSettings) if s.name == name]
    assert COMPUTE.get_default(name) == spec.default
    assert UP.get_default(name) == LOCAL_NODE_DEFAULTS.get(name, spec.default)
    assert from_compute([]) == NodeSettings()  # the defaults are valid settings


def test_up_differs_only_where_the_local_cluster_says_so():
    assert from_up([]) == NodeSettings(engine=dataclasses.replace(NodeSettings().engine, **LOCAL_NODE_DEFAULTS))
    assert LOCAL_NODE_DEFAULTS == {"block_size": 16, "kv_cache_memory": 64 << 20}  # README: kvfleet up's blocks of 16


def test_every_value_reads_the_same_from_compute_up_a_config_file_and_the_local_argv(tmp_path):
    text = {name: given for name, (given, _) in SAMPLES.items()}
    want = build(NodeSettings, {name: value for name, (_, value) in SAMPLES.items()})
    assert want != NodeSettings() and from_compute(flags(text)) == want
    assert from_up(flags(text)) == want
    path = tmp_path / "cluster.yaml"
    path.write_text(dump_yaml(text, "every node setting"))
    assert from_config(path) == want
    # the local cluster's argv for a node: the same settings, its disk tier in a directory of its own
    command = node_command(want, "m", "n0", "127.0.0.1:1", "http://127.0.0.1:2", None, None)
    again = build(NodeCommand, COMPUTE.parse_args(to_argv(command)))
    assert again.settings.engine.kv_disk_dir == f"{DISK}/n0"
    assert dataclasses.replace(again.settings, engine=dataclasses.replace(again.settings.engine, kv_disk_dir=DISK)) \
        == want
    assert to_argv(node_command(NodeSettings(), "m", "n0", "127.0.0.1:1", "http://e:2", None, None)) == [
        "--model", "m", "--node-id", "n0", "--listen", "127.0.0.1:1", "--etcd", "http://e:2"]  # defaults left out


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_the_same_line_from_compute_up_and_a_config_file(name, tmp_path):
    given, line = BAD[name]
    for read in (from_compute, from_up):
        with pytest.raises(SettingError) as refused_here:
            read(flags({name: given}))
        assert str(refused_here.value) == line
    path = tmp_path / "bad.yaml"
    path.write_text(dump_yaml({name: given}, ""))
    with pytest.raises(ConfigError) as refused_here:
        from_config(path)
    assert str(refused_here.value) == f"{path}: {line}"


@pytest.mark.parametrize("flag, value, line", [
    ("--block-size", "17", BAD["block_size"][1]),
    ("--max-model-len", "0", BAD["max_model_len"][1]),
])
def test_each_command_refuses_a_bad_value_in_one_line_and_exit_2(flag, value, line, tmp_path, model):  # noqa: F811
    compute = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), flag, value, tmp_path=tmp_path)
    up = refused("up", "--model", str(model), flag, value, tmp_path=tmp_path)
    config = tmp_path / "up.yaml"
    config.write_text(f"{flag[2:]}: {value}\n")
    from_file = refused("up", "--model", str(model), "--config", str(config), tmp_path=tmp_path)
    assert (compute, up, from_file) == (f"kvfleet compute: {line}", f"kvfleet up: {line}", f"kvfleet up: {config}: {line}")


def test_a_preset_block_size_passes_both_commands_checks(tmp_path):
    """``--block-size chat`` is no mistake: what stops these commands is the missing model."""
    missing = tmp_path / "nope"
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(missing), "--block-size", "chat",
                   tmp_path=tmp_path)
    assert line == f"kvfleet compute: model directory {missing} does not exist"
    line = refused("up", "--model", str(missing), "--block-size", "chat", tmp_path=tmp_path)
    assert line == f"kvfleet up: {missing} is not a model directory (no config.json)"
