"""``--kv-cache-dtype`` on ``kvfleet compute`` and ``kvfleet up``: an unknown name is one line and a
non-zero exit before anything starts (no model load, no cluster)."""

from __future__ import annotations

from tests.cli.test_first_contact import model, refused  # noqa: F401 - the fixture is used

CHOICES = "auto, float32, bfloat16, float16, fp8_e4m3"


def test_compute_refuses_an_unknown_kv_cache_dtype(tmp_path, model):  # noqa: F811
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model), "--kv-cache-dtype", "fp8",
                   tmp_path=tmp_path)
    assert line == f"kvfleet compute: --kv-cache-dtype must be one of {CHOICES}, got 'fp8'"


def test_up_refuses_an_unknown_kv_cache_dtype(tmp_path, model):  # noqa: F811
    line = refused("up", "--model", str(model), "--kv-cache-dtype", "int8", tmp_path=tmp_path)
    assert line == f"kvfleet up: --kv-cache-dtype must be one of {CHOICES}, got 'int8'"
