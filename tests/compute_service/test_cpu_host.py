"""The CPU host's answers: intra-op threads (one CPU left to the rest of the process and the host)
and the ``auto`` dtype (bfloat16 where the CPU runs it natively)."""

import pytest

from kvfleet.compute_service.engine.cpu_host import cpu_flags, intra_op_threads, resolve_dtype

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_threads_leave_one_cpu_free():
    assert intra_op_threads(2, {}) == 1
    assert intra_op_threads(16, {}) == 15
    assert intra_op_threads(1, {}) == 1


def test_threads_follow_the_environment():
    assert intra_op_threads(2, {"KVFLEET_CPU_THREADS": "2"}) == 2
    assert intra_op_threads(8, {"OMP_NUM_THREADS": "4"}) is None  # torch already read it
    assert intra_op_threads(8, {"OMP_NUM_THREADS": "4", "KVFLEET_CPU_THREADS": "3"}) == 3


@pytest.mark.parametrize("bad", ["0", "-1", "two", ""])
def test_threads_refuse_a_bad_count(bad):
    with pytest.raises(ValueError, match="KVFLEET_CPU_THREADS must be a positive integer"):
        intra_op_threads(2, {"KVFLEET_CPU_THREADS": bad})


def test_cpu_flags_read_the_first_processor():
    flags = cpu_flags(CPUINFO)
    assert "avx512_bf16" in flags and "amx_bf16" not in flags
    assert cpu_flags("processor\t: 0\n") == frozenset()


def test_auto_dtype_is_bfloat16_only_where_native():
    assert resolve_dtype("auto", "cpu", cpu_flags(CPUINFO)) == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"amx_bf16", "amx_tile"})) == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"avx2", "avx512f"})) == "float32"
    assert resolve_dtype("auto", "cuda", cpu_flags(CPUINFO)) == "float32"
    assert resolve_dtype("float32", "cpu", cpu_flags(CPUINFO)) == "float32"
    assert resolve_dtype("bfloat16", "cpu", frozenset()) == "bfloat16"
