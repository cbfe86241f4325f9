"""``--kv-layout`` on ``kvfleet compute`` and ``kvfleet up``: an unknown layout is one line and a
non-zero exit before anything starts; a contiguous reservation the pool cannot hold is one line at
start (after the model loads, before the node serves or registers anything)."""

from __future__ import annotations

from tests.cli.test_first_contact import model, refused  # noqa: F401 - the fixture is used

BLOCK_BYTES = 2 * 4 * 2 * 32 * 4 * 16  # a 16-token block of the tiny preset in float32


def test_compute_refuses_an_unknown_kv_layout(tmp_path, model):  # noqa: F811
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), "--kv-layout", "ragged",
                   tmp_path=tmp_path)
    assert line == "kvfleet compute: --kv-layout must be one of paged, contiguous, got 'ragged'"


def test_up_refuses_an_unknown_kv_layout(tmp_path, model):  # noqa: F811
    line = refused("up", "--model", str(model), "--kv-layout", "Contiguous", tmp_path=tmp_path)
    assert line == "kvfleet up: --kv-layout must be one of paged, contiguous, got 'Contiguous'"


def test_compute_refuses_a_reservation_larger_than_its_pool(tmp_path, model):  # noqa: F811
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), "--kv-layout", "contiguous",
                   "--block-size", "16", "--kv-cache-memory", str(100 * BLOCK_BYTES), "--max-model-len", "2048",
                   "--dtype", "float32",
                   tmp_path=tmp_path)
    assert line == ("kvfleet compute: --kv-layout contiguous reserves max_model_len 2048 tokens (128 blocks of 16) "
                    "per sequence, but the pool holds 100 blocks: lower --max-model-len or raise --kv-cache-memory")
