"""The OpenAI door's conversation id for a canary split: ``prompt_cache_key``, else ``user``."""

from __future__ import annotations

import pytest

from kvfleet.router.canary_split import conversation_key
from kvfleet.router.openai_requests import ApiError, parse_call

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_prompt_cache_key_wins_over_user_and_neither_leaves_the_messages() -> None:
    assert parse_call({**CHAT, "prompt_cache_key": "k1", "user": "u1"}, "chat").conversation == "k1"
    assert parse_call({**CHAT, "user": "u1"}, "chat").conversation == "u1"
    assert parse_call(CHAT, "chat").conversation == ""
    assert parse_call({"model": "m", "prompt": "x", "user": "u2"}, "completion").conversation == "u2"
    assert conversation_key("u1") != conversation_key("", [("user", "hi")])


def test_a_conversation_id_that_is_not_a_string_is_refused_naming_the_field() -> None:
    with pytest.raises(ApiError) as err:
        parse_call({**CHAT, "prompt_cache_key": 5}, "chat")
    assert err.value.param == "prompt_cache_key"
