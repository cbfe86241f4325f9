"""Tiny models for the engine tests (built once per session) and the transformers reference."""

from __future__ import annotations

import random

import pytest
import torch

from kvfleet.cli.model_maker import make_model
from kvfleet.compute_service.blocks.registration import RemoteAllocatorFactory
from tests.compute_service.served_blocks import BS, BYTES_PER_BLOCK, HeldAsks, Served

VARIANTS = {
    "llama": dict(architecture="llama"),
    "qwen2": dict(architecture="qwen2", tie_word_embeddings=True),   # q/k/v bias, tied embeddings
    "mqa": dict(architecture="llama", num_key_value_heads=1),        # one KV head
    "mistral": dict(architecture="mistral"),
    "llama3_rope": dict(architecture="llama", rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256)),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(root / name, "tiny", seed=7, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def late_stop_string(text: str, start: int) -> str:
    """A two-character printable ASCII string whose first occurrence in ``text`` (generated text,
    mostly bytes that decode to nothing printable) is at character ``start`` or later."""
    for i in range(start, len(text) - 1):
        candidate = text[i:i + 2]
        if candidate.isascii() and candidate.isprintable() and text.find(candidate) == i:
            return candidate
    raise AssertionError(f"no printable stop string after character {start} of {text!r}")


class HFReference:
    """Greedy tokens and last-position logits from ``transformers`` in float32, cached per prompt."""

    def __init__(self, model_dir):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple, tuple[list[int], torch.Tensor]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=257, pad_token_id=258, output_logits=True,
                                      return_dict_in_generate=True)
            self._cache[key] = (out.sequences[0, len(prompt):].tolist(), out.logits[0][0].float())
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_reference(model_dirs):
    refs: dict[str, HFReference] = {}

    def get(name: str) -> HFReference:
        if name not in refs:
            refs[name] = HFReference(model_dirs[name])
        return refs[name]

    return get


@pytest.fixture
def served():
    served = Served()
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def node(served):
    """(allocator, run-on-loop, block_service's client) with block_service served in-process
    (served_blocks.py)."""
    factory = RemoteAllocatorFactory(HeldAsks(served.client), "n0", served.loop)
    allocator = factory(64, BS, BYTES_PER_BLOCK)  # called off the loop, as the engine does
    try:
        yield allocator, served.on_loop, served.client
    finally:
        served.on_loop(factory.close(deregister=served.up))
