"""The native causal prefill (csrc/prefill_cpu.cpp) against float64 dense attention."""

import pytest
import torch

from kvfleet import kernels
from kvfleet.kernels import cpu_kernels, cpu_prefill
from kvfleet.kernels.testing import assert_close, dense_attention, make_case

pytestmark = pytest.mark.skipif(not cpu_kernels.load_extension(), reason="native CPU kernel did not build")


def tight(out, case):
    """float32 greedy tokens must equal transformers': within float32 rounding of dense float64."""
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (12, 4), (6, 1)])
def test_head_dims_and_groups(head_dim, num_heads, num_kv_heads):
    # whole prompts (1, 7, 65 rows: past one 64-key tile, rows past a block of rows), chunks after a prefix
    case = make_case([1, 7, 65, 300, 1030], q_lens=[1, 7, 65, 45, 130], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16)
    assert cpu_kernels.supports_prefill(case.query, case.cache)
    tight(kernels.paged_prefill(*case.args()), case)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_block_sizes_and_a_long_prompt(block_size):
    case = make_case([2049, 640], q_lens=[2049, 1], block_size=block_size, num_heads=8, num_kv_heads=2)
    tight(cpu_prefill.cpu_paged_prefill(*case.args()), case)


def test_bfloat16_rows_widened():
    case = make_case([90, 300], q_lens=[90, 64], dtype=torch.bfloat16, num_heads=8, num_kv_heads=2)
    meta = case.meta
    out = torch.cat([cpu_kernels.causal_prefill(case.query[s:e], case.cache, meta.prefill_block_tables[b], ctx,
                                                case.params.scale)
                     for b, (s, e, ctx) in enumerate([(0, 90, 90), (90, 154, 300)])])
    assert out.dtype == torch.bfloat16
    assert_close(out, dense_attention(case))


def test_bfloat16_through_the_dispatch():
    case = make_case([1, 77, 300], q_lens=[1, 77, 100], dtype=torch.bfloat16, num_heads=6, num_kv_heads=2)
    assert cpu_kernels.supports_prefill(case.query, case.cache)
    assert_close(kernels.paged_prefill(*case.args()), dense_attention(case))


def test_what_it_does_not_serve_goes_elsewhere():
    fp16 = make_case([40], q_lens=[40], dtype=torch.float16)
    fp8 = make_case([40], q_lens=[40], cache_dtype=torch.float8_e4m3fn)
    odd = make_case([40], q_lens=[40], head_dim=40)
    for case in (fp16, fp8, odd):
        assert not cpu_kernels.supports_prefill(case.query, case.cache)
        assert_close(kernels.paged_prefill(*case.args()), dense_attention(case))


def test_bad_calls_are_one_clear_error_each():
    case = make_case([40], q_lens=[40], head_dim=64, block_size=16)
    table = case.meta.prefill_block_tables[0]
    with pytest.raises(RuntimeError, match="context_len 39 < the 40 new tokens"):
        cpu_kernels.causal_prefill(case.query, case.cache, table, 39, 0.125)
    bad = table.clone()
    bad[1] = case.cache.k.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.causal_prefill(case.query, case.cache, bad, 40, 0.125)
    with pytest.raises(RuntimeError, match="enough blocks"):
        cpu_kernels.causal_prefill(case.query, case.cache, table[:1], 40, 0.125)
    odd = make_case([8], q_lens=[8], head_dim=40)
    with pytest.raises(RuntimeError, match="head dim 40 is not one this kernel is built for"):
        cpu_kernels.causal_prefill(odd.query, odd.cache, odd.meta.prefill_block_tables[0], 8, 0.1)
