"""The Triton kernels under TRITON_INTERPRET=1 on the CPU, against float64 dense attention.

The interpreter must be on when ``@triton.jit`` runs, so the kernel modules are imported here with
the variable set and then taken out of ``sys.modules`` again: no other test sees interpreted kernels.
On a GPU machine, ``bench/gpu_kernels.sh`` runs this module with ``KVFLEET_TRITON_DEVICE=cuda``.
"""

import importlib
import os
import sys

import pytest
import torch

from kernels.testing import assert_close, dense_attention, make_case

DEVICE = os.environ.get("KVFLEET_TRITON_DEVICE", "cpu")
MODULES = ("kernels.triton_store", "kernels.triton_decode", "kernels.triton_prefill")


def _import_kernels():
    saved = {name: sys.modules.pop(name, None) for name in MODULES}
    old = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        return [importlib.import_module(name) for name in MODULES]
    finally:
        if DEVICE == "cpu":
            for name in MODULES:
                sys.modules.pop(name, None)
                if saved[name] is not None:
                    sys.modules[name] = saved[name]


@pytest.fixture(scope="module")
def triton_kernels(request):
    pytest.importorskip("triton")
    modules = _import_kernels()
    if DEVICE == "cpu":  # the launchers read the variable again when they run
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        yield modules
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    else:
        yield modules


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_odd_lengths(triton_kernels, block_size):
    _, decode, _ = triton_kernels
    case = make_case([1, 17, 255, 1030], block_size=block_size, num_heads=8, num_kv_heads=2, device=DEVICE)
    assert_close(decode.triton_paged_decode(*case.decode_args()), dense_attention(case))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_kv(triton_kernels, num_splits):
    _, decode, _ = triton_kernels
    case = make_case([2, 40, 1500], block_size=32, device=DEVICE)
    out = decode.triton_paged_decode(*case.decode_args(), num_splits=num_splits)
    assert_close(out, dense_attention(case))
