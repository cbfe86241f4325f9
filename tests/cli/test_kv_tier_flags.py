"""The KV tier flags on ``kvfleet compute`` and ``kvfleet up``: what cannot work is one line and exit
2 before anything starts."""

from __future__ import annotations

from tests.cli.test_first_contact import model, refused  # noqa: F401 - the fixture is used


def test_compute_refuses_a_disk_dir_without_its_size(tmp_path, model):  # noqa: F811
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), "--kv-host-memory", "1048576",
                   "--kv-disk-dir", str(tmp_path / "kv"), tmp_path=tmp_path)
    assert line == ("kvfleet compute: --kv-disk-dir and --kv-disk-bytes go together (a directory and its size "
                    "in bytes)")


def test_compute_refuses_an_unknown_preemption_mode(tmp_path, model):  # noqa: F811
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), "--preemption-mode", "never",
                   tmp_path=tmp_path)
    assert line == "kvfleet compute: --preemption-mode must be one of auto, swap, recompute, got 'never'"


def test_up_refuses_a_host_tier_larger_than_the_machine(tmp_path, model):  # noqa: F811
    line = refused("up", "--model", str(model), "--kv-host-memory", str(1 << 62), tmp_path=tmp_path)
    assert line.startswith(f"kvfleet up: --kv-host-memory {1 << 62} bytes is more than this machine's memory")


def test_up_refuses_a_negative_long_prefill_threshold(tmp_path, model):  # noqa: F811
    line = refused("up", "--model", str(model), "--long-prefill-token-threshold", "-1", tmp_path=tmp_path)
    assert line == "kvfleet up: --long-prefill-token-threshold must be at least 0, got -1"
