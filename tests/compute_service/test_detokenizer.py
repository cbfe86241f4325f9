"""Streamed text is exact UTF-8: on a byte-level tokenizer every multi-byte character is split
across tokens, so each piece must hold back the bytes of an unfinished character, and the pieces
must add up to the decode of all the tokens."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvfleet.core.sampling import SamplingParams

TEXT = "你好，世界！🙂🎉 KV 缓存 — naïve ok 👩‍👩‍👧"


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


def pieces_of(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.push(t) for t in ids], detok


def test_split_characters_are_held_back_until_complete(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token per byte: every non-ASCII character is split
    pieces, detok = pieces_of(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert detok.flush() == ""
    # a piece is empty while a character is incomplete, then carries the whole character
    assert pieces[:3] == ["", "", "你"]


def test_an_unfinished_character_at_the_end_is_flushed_as_decode_ends_it(tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-2] + tokenizer.encode("中")[:1]
    pieces, detok = pieces_of(tokenizer, ids)
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)
    assert tokenizer.decode(ids).endswith("\ufffd")


def test_engine_output_text_is_the_decode_of_its_tokens(llama_dir, tokenizer):
    """A random model emits random bytes: outputs end in the middle of characters, and invalid
    sequences occur; the text streamed still equals the decode of the tokens streamed."""
    engine = LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
    prompts = ["你好", "🙂 emoji", "abc", "日本語のテキスト", "x" * 20, "é"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=23, ignore_eos=True))
    for out in outs:
        assert out.new_text == tokenizer.decode(out.new_token_ids)
    assert any(tokenizer.decode(o.new_token_ids).endswith("\ufffd") for o in outs)  # the case that matters
