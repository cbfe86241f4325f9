"""The router's and block_service's flags come from their settings dataclasses: a bad value, or two
settings that cannot go together, is one line and exit 2 before anything starts."""

from __future__ import annotations

import argparse

import pytest

from kvfleet.block_service import main as block_service_main
from kvfleet.block_service.settings import BlockServiceSettings
from kvfleet.core.settings import build, to_argv
from kvfleet.router import main as router_main
from kvfleet.router.settings import RouterSettings
from tests.cli.test_first_contact import refused

ROUTER = ["--etcd", "http://127.0.0.1:1", "--tenants", "t.yaml"]


def parsed(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, line", [
    (["--queue-size", "0"], "--queue-size must be at least 1, got 0"),
    (["--capacity", "many"], "--capacity must be an integer, got 'many'"),
    (["--decode-block-weight", "1.5"], "--decode-block-weight must be at most 1, got 1.5"),
    (["--wait-scale-s", "0"], "--wait-scale-s must be positive, got 0"),
    (["--metrics-port", "70000"], "--metrics-port must be a port (0-65535), got '70000'"),
])
def test_the_router_refuses_a_bad_value_in_one_line(argv, line):
    with pytest.raises(ValueError) as refused_here:
        build(RouterSettings, parsed(router_main.add_arguments, [*ROUTER, *argv]))
    assert str(refused_here.value) == line


@pytest.mark.parametrize("argv, line", [
    (["--durability", "maybe"], "--durability must be one of fsync, write, off, got 'maybe'"),
    (["--snapshot-interval", "5x"], "--snapshot-interval-s: not a duration: '5x' (seconds, or 30s / 5m / 1h)"),
    (["--sync-standby"], "--standby and --sync-standby need --etcd (the replicas elect their leader there)"),
    (["--etcd", "http://e:1", "--lease-ttl", "1"], "--lease-ttl must be at least 2 seconds with --etcd, got 1"),
])
def test_block_service_refuses_a_bad_value_in_one_line(argv, line):
    with pytest.raises(ValueError) as refused_here:
        build(BlockServiceSettings, parsed(block_service_main.add_arguments, argv))
    assert str(refused_here.value) == line


def test_settings_read_back_from_their_argv():
    router = build(RouterSettings, parsed(router_main.add_arguments, [*ROUTER, "--capacity", "8",
                                                                       "--prefix-weight", "2"]))
    assert build(RouterSettings, parsed(router_main.add_arguments, to_argv(router))) == router
    blocks = build(BlockServiceSettings, parsed(block_service_main.add_arguments,
                                                ["--snapshot-interval", "5m", "--etcd", "http://e:1", "--standby"]))
    assert (blocks.snapshot_interval_s, blocks.standby) == (300.0, True)
    assert build(BlockServiceSettings, parsed(block_service_main.add_arguments, to_argv(blocks))) == blocks


def test_both_commands_say_it_in_one_line_and_exit_2(tmp_path):
    line = refused("router", *ROUTER, "--insecure-internal", "--queue-size", "0", tmp_path=tmp_path)
    assert line == "kvfleet router: --queue-size must be at least 1, got 0"
    line = refused("block-service", "--insecure-internal", "--state-dir", str(tmp_path / "s"), "--durability", "maybe",
                   tmp_path=tmp_path)
    assert line == "kvfleet block-service: --durability must be one of fsync, write, off, got 'maybe'"
