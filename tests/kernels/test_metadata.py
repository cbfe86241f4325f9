"""The attention metadata, layer cache and layer parameters refuse a malformed object where it is
built, with one line that names the field; the kernels take it as checked."""

import pytest
import torch

from kvfleet import kernels
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache
from kvfleet.kernels.testing import assert_close, dense_attention, make_case


def engine_step(**change) -> AttentionMetadata:
    """Two prefill chunks (5 and 3 tokens) and two decodes, as the engine packs them; ``change``
    replaces fields."""
    i32 = dict(dtype=torch.int32)
    fields = dict(
        slot_mapping=torch.arange(10), num_prefill_tokens=8,
        prefill_block_tables=torch.zeros(2, 3, **i32), prefill_context_lens=torch.tensor([5, 20], **i32),
        prefill_query_start_loc=torch.tensor([0, 5, 8], **i32),
        decode_block_tables=torch.zeros(2, 4, **i32), decode_context_lens=torch.tensor([7, 50], **i32),
    )
    return AttentionMetadata(**{**fields, **change})


def test_well_formed_step():
    meta = engine_step()
    assert (meta.num_prefills, meta.num_decodes, meta.num_prefill_tokens) == (2, 2, 8)


@pytest.mark.parametrize("change,message", [
    (dict(decode_block_tables=torch.zeros(2, 4, dtype=torch.int64)), "decode_block_tables must be int32"),
    (dict(slot_mapping=torch.arange(10, dtype=torch.int32)), "slot_mapping must be int64"),
    (dict(prefill_context_lens=torch.tensor([5, 20, 1], dtype=torch.int32)), "2 prefill block tables for 3"),
    (dict(prefill_query_start_loc=torch.tensor([0, 8], dtype=torch.int32)), "has 2 entries, expected 3"),
    (dict(decode_context_lens=torch.tensor([7], dtype=torch.int32)), "2 decode block tables for 1"),
    (dict(slot_mapping=torch.arange(9)), "9 slots for 8 prefill tokens and 2 decode tokens"),
    (dict(decode_block_tables=torch.zeros(4, 2, dtype=torch.int32).t()), "decode_block_tables must be contiguous"),
    (dict(decode_context_lens=torch.zeros(2, 1, dtype=torch.int32)), r"decode_context_lens has shape \(2, 1\)"),
])
def test_malformed_metadata_is_refused_with_one_line(change, message):
    with pytest.raises(ValueError, match=message) as refused:
        engine_step(**change)
    assert str(refused.value).startswith("AttentionMetadata: ") and "\n" not in str(refused.value)


@pytest.mark.parametrize("params,message", [
    (dict(scale=0.0), "scale must be positive"),
    (dict(scale=0.1, window=0), "window must be positive or None"),
    (dict(scale=0.1, logit_softcap=-1.0), "logit_softcap must be positive or None"),
])
def test_malformed_params_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        AttentionParams(**params)


@pytest.mark.parametrize("k,v,message", [
    (torch.zeros(2, 1, 8, 16), None, "block_size 8 is not a multiple of 16"),
    (torch.zeros(2, 1, 16, 8), torch.zeros(2, 1, 16, 4), "k and v differ"),
    (torch.zeros(2, 1, 16, 8), torch.zeros(2, 1, 16, 8, dtype=torch.bfloat16), "share dtype"),
    (torch.zeros(2, 16, 8), None, "k must be"),
])
def test_malformed_cache_is_refused(k, v, message):
    with pytest.raises(ValueError, match=message):
        LayerCache(k, k.clone() if v is None else v)


def test_kernels_do_not_check_again(monkeypatch):
    """Checked once, where built: the calls per layer run no metadata check of their own."""
    decode = make_case([17, 40], logit_softcap=2.0)
    prefill = make_case([17, 40], q_lens=[17, 9])
    calls = []
    for cls in (AttentionMetadata, LayerCache, AttentionParams):
        monkeypatch.setattr(cls, "__post_init__", lambda self: calls.append(type(self)))
    assert_close(kernels.paged_decode(*decode.args()), dense_attention(decode))
    assert_close(kernels.paged_prefill(*prefill.args()), dense_attention(prefill))
    assert calls == []
