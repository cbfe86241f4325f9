"""Every supported config feature, served by the paged engine, gives transformers' greedy tokens
(float32, one prompt at a time) — prompts long enough to cross the RoPE scaling's original length."""

from __future__ import annotations

import pytest
import torch

from kvfleet.cli.model_maker import make_model
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.model.architectures import ARCHITECTURES
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.test_engine_matches_transformers import capture_first_logits
from tests.models.hf_models import CASES, ROPES, build, prompt, reference_tokens

MAX_NEW = 8
PROMPTS = [prompt(n, seed=n) for n in (3, 40, 100)]


def engine_tokens(model_dir, prompts, block_size: int = 16) -> list[list[int]]:
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=block_size, kv_cache_memory=16 << 20))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return [o.new_token_ids for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_transformers(tmp_path, case):
    model_dir = build(tmp_path / case, case)
    assert engine_tokens(model_dir, PROMPTS) == reference_tokens(model_dir, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("case", [f"rope_{name}" for name in ROPES])
def test_legacy_rope_format_gives_the_same_tokens(tmp_path, case):
    """transformers 4's ``rope_theta`` + ``rope_scaling`` describes the same model: the engine reads
    it into the same rotation and both sides agree on the same tokens."""
    current = build(tmp_path / "current", case)
    legacy = build(tmp_path / "legacy", case, legacy=True)
    want = reference_tokens(legacy, PROMPTS, MAX_NEW)
    assert want == reference_tokens(current, PROMPTS, MAX_NEW)
    assert engine_tokens(legacy, PROMPTS) == want


@pytest.mark.parametrize("case", ["rope_yarn", "rope_llama3", "attention_bias"])
def test_models_are_sensitive(tmp_path, case):
    """The test models are strong enough that a wrong RoPE base changes transformers' own tokens
    (so a wrongly scaled rotation could not pass the tests above by luck)."""
    same = reference_tokens(build(tmp_path / "a", case), PROMPTS, MAX_NEW)
    other = reference_tokens(build(tmp_path / "b", case, rope_theta_times=1.5), PROMPTS, MAX_NEW)
    assert all(a != b for a, b in zip(same[1:], other[1:]))


@pytest.mark.parametrize("case, changes", [
    ("phi3", dict(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0})),  # RoPE over all of each head
    ("phi3_window", dict(sliding_window=None)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=24)),  # head_dim's scale instead of Gemma 2's own
    ("gemma2", dict(layer_types=["full_attention"] * 3)),
])
def test_new_architectures_are_sensitive(tmp_path, case, changes):
    """What Phi-3 and Gemma 2 add changes transformers' own tokens on these models: partial rotation,
    the attention soft-cap, the attention scale, the sliding layers."""
    same = reference_tokens(build(tmp_path / "a", case), PROMPTS, MAX_NEW)
    other = reference_tokens(build(tmp_path / "b", case, **changes), PROMPTS, MAX_NEW)
    assert same[1:] != other[1:]


@torch.inference_mode()
def test_gemma2_logits_are_soft_capped_as_transformers_caps_them(tmp_path):
    """The final soft-cap changes no greedy token (tanh keeps the order), so its logits are compared."""
    import transformers

    model_dir = build(tmp_path / "gemma2", "gemma2")
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=16 << 20))
    seen = capture_first_logits(engine)
    engine.generate(PROMPTS, SamplingParams(max_tokens=1))
    got = {int(seq_id.rsplit("-", 1)[1]): logits for seq_id, logits in seen.items()}  # generate's ids end in -i
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(PROMPTS):
        want = reference(torch.tensor([p])).logits[0, -1]
        assert want.abs().max() < 5.0 < 2 * want.abs().max()  # the cap (5) bites
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_the_model_maker_writes_every_architecture(tmp_path, model_type):
    """``kvfleet make-model --architecture`` takes every entry of the table and writes a directory
    transformers reads as that architecture and computes the engine's tokens from."""
    model_dir = make_model(tmp_path / model_type, "tiny", architecture=model_type, seed=5)
    assert engine_tokens(model_dir, PROMPTS) == reference_tokens(model_dir, PROMPTS, MAX_NEW)
