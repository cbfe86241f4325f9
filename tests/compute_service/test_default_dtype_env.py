"""KVFLEET_DEFAULT_DTYPE: what ``auto`` resolves to, whatever the CPU (so one machine can run every
benchmark under both defaults), and nothing else."""

import pytest

from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.engine.cpu_host import DEFAULT_DTYPE_ENV, resolve_dtype

NATIVE = frozenset({"amx_bf16"})


def test_the_override_fixes_auto_on_any_cpu():
    assert resolve_dtype("auto", "cpu", frozenset(), {DEFAULT_DTYPE_ENV: "bfloat16"}) == "bfloat16"
    assert resolve_dtype("auto", "cpu", NATIVE, {DEFAULT_DTYPE_ENV: "float32"}) == "float32"
    assert resolve_dtype("auto", "cpu", NATIVE, {DEFAULT_DTYPE_ENV: ""}) == "bfloat16"  # empty: unset
    assert resolve_dtype("auto", "cpu", NATIVE, {}) == "bfloat16"


def test_the_override_leaves_named_dtypes_alone():
    assert resolve_dtype("float32", "cpu", NATIVE, {DEFAULT_DTYPE_ENV: "bfloat16"}) == "float32"
    assert resolve_dtype("bfloat16", "cpu", frozenset(), {DEFAULT_DTYPE_ENV: "float32"}) == "bfloat16"


def test_a_bad_override_is_one_line():
    with pytest.raises(ValueError, match=f"^{DEFAULT_DTYPE_ENV} must be one of float32, bfloat16, got 'fp8'$"):
        resolve_dtype("auto", "cpu", frozenset(), {DEFAULT_DTYPE_ENV: "fp8"})


def test_the_engine_config_reads_it(monkeypatch):
    for chosen in ("bfloat16", "float32"):
        monkeypatch.setenv(DEFAULT_DTYPE_ENV, chosen)
        assert EngineConfig().dtype == chosen
        assert EngineConfig(dtype="float16").dtype == "float16"
