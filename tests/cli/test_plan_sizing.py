"""Hardware sizing: the roofline's step time by hand, the replicas memory and prefill force, the
guide's table beside it, and a target no hardware reaches at the given concurrency."""

from __future__ import annotations

import pytest

from kvfleet.cli.planning.capacity import CapacityRequest
from kvfleet.cli.planning.devices import DEVICES, guide_verdict
from kvfleet.cli.planning.plan import ContextTooLong, make_plan
from kvfleet.cli.planning.shapes import PRESETS
from kvfleet.cli.planning.sizing import SizingRequest, decode_step

LLAMA8, A100 = PRESETS["llama-3.1-8b"], DEVICES["a100-80g"]


def sized(model, device, context, target, concurrency, tp=1, avg_output=256):
    plan = make_plan(model, device, CapacityRequest(context=context, tensor_parallel=tp),
                     SizingRequest(target, context, concurrency, avg_output))
    return plan.sizing


def test_one_sequence_decode_reads_the_weights_and_its_kv_once_per_token():
    s = sized(LLAMA8, A100, 1000, 10, 1)
    assert s.decode_bound == "memory bandwidth"
    assert s.decode_step_s == pytest.approx((8_030_261_248 * 2 + 1000 * 131_072) / 2.039e12)
    assert s.devices_needed == 1
    prefill_flops_per_token = 2 * 8_030_261_248 + 4 * 32 * 32 * 128 * 500  # weights + attention at half the context
    assert s.prefill_tokens_per_s_per_replica == pytest.approx(312e12 / prefill_flops_per_token)


def test_a_large_batch_of_short_sequences_is_compute_bound():
    step, bound = decode_step(LLAMA8, A100, 1, 131_072, batch=2000, context=16)
    assert bound == "compute"
    assert step == pytest.approx(2000 * LLAMA8.flops_per_token(16) / 312e12)


def test_concurrency_beyond_one_devices_kv_takes_more_replicas():
    # 3 sequences of 128K fit an A100 next to the 8B weights: 10 need 4 devices
    s = sized(LLAMA8, A100, 131072, 1, 10)
    assert (s.replicas, s.devices_needed, s.seqs_per_replica) == (4, 4, 3)


def test_tensor_parallel_replicas_count_every_device():
    s = sized(PRESETS["llama-3.1-70b"], DEVICES["h100-80g"], 8192, 6000, 256, tp=4)
    assert s.devices_needed == 4 * s.replicas
    assert s.achieved_tokens_per_s >= 6000
    assert s.guide == "H100s with InfiniBand (no count given)"


def test_more_tokens_never_need_fewer_devices():
    needed = [sized(LLAMA8, A100, 4096, target, 256).devices_needed for target in (500, 2000, 5000, 10000, 20000)]
    assert needed == sorted(needed) and needed[0] < needed[-1]


@pytest.mark.parametrize("target, avg_output, says", [
    (1e6, 256, "prefill alone"),                   # 4M prompt tokens/s: more than 4 replicas' compute
    (1e5, 10**6, "out of reach at concurrency 4"),  # 4 sequences: 4 tokens per (shortest) step
])
def test_a_target_out_of_reach_at_this_concurrency_says_so(target, avg_output, says):
    s = sized(LLAMA8, A100, 1000, target, 4, avg_output=avg_output)
    assert s.devices_needed is None and s.replicas is None
    assert says in s.note and "raise --concurrency" in s.note


def test_a_model_without_room_for_one_sequence_says_so():
    s = sized(PRESETS["llama-3.1-70b"], A100, 1000, 100, 4)
    assert s.devices_needed is None and "raise --tensor-parallel" in s.note


@pytest.mark.parametrize("tokens, verdict", [(1999, "1 x A100-80G"), (2000, "2 x A100-80G with NVLink"),
                                             (5000, "2 x A100-80G with NVLink"),
                                             (5001, "H100s with InfiniBand (no count given)")])
def test_the_guides_table(tokens, verdict):
    assert guide_verdict(tokens) == verdict


def test_moe_decode_reads_the_experts_the_batch_touches():
    model = PRESETS["deepseek-v3"]
    one = model.decode_weight_bytes(1)
    assert one == model.num_params(active_only=True) * 1  # one token: its 8 experts, FP8
    assert one < model.decode_weight_bytes(16) < model.decode_weight_bytes(4096) <= model.weights_bytes()
    assert model.decode_weight_bytes(4096) == pytest.approx(model.weights_bytes(), rel=1e-6)


def test_a_context_past_the_models_positions_is_refused_unless_forced():
    request = CapacityRequest(context=65536)
    with pytest.raises(ContextTooLong, match="32,768 positions"):
        make_plan(PRESETS["qwen2.5-7b"], A100, request)
    plan = make_plan(PRESETS["qwen2.5-7b"], A100, request, force=True)
    assert any("32,768 positions" in w for w in plan.warnings)
