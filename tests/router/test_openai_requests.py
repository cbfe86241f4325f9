"""OpenAI request bodies → OpenAICall, and the answers' shapes. Every refusal names its field."""

from __future__ import annotations

import pytest

from kvfleet.core.sampling import SamplingParams
from kvfleet.router.chat_template import ChatMessage
from kvfleet.router.openai_requests import MAX_MAX_TOKENS, ApiError, parse_call
from kvfleet.router.openai_responses import Answer, Usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def test_completion_defaults_follow_openai():
    call = parse_call(COMPLETION, "completion")
    assert (call.kind, call.model, call.text, call.token_ids, call.stream) == ("completion", "m", "hi", None, False)
    assert call.sampling == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)


def test_every_supported_parameter_is_mapped():
    call = parse_call({**CHAT, "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
                       "seed": 3, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
                       "top_k": 5, "ignore_eos": True, "n": 1, "user": "u", "logprobs": False}, "chat")
    assert call.sampling == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=5, seed=3, stop=("\n",),
                                           ignore_eos=True)
    assert call.stream and call.include_usage
    assert call.messages == (ChatMessage("user", "hi"),)
    assert parse_call(CHAT, "chat").sampling.max_tokens == MAX_MAX_TOKENS  # until the end of the turn


def test_prompts_and_message_contents_in_their_several_forms():
    assert parse_call({**COMPLETION, "prompt": [5, 6]}, "completion").token_ids == (5, 6)
    assert parse_call({**COMPLETION, "prompt": ["one"]}, "completion").text == "one"
    assert parse_call({**COMPLETION, "prompt": [[1, 2]]}, "completion").token_ids == (1, 2)
    call = parse_call({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, "chat")
    assert call.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "ab"))


@pytest.mark.parametrize("body, kind, param, message", [
    ("[1]", "chat", None, "must be a JSON object"),
    ({"messages": CHAT["messages"]}, "chat", "model", "model is required"),
    ({**CHAT, "n": 2}, "chat", "n", "n=2 is not supported"),
    ({**CHAT, "tools": [{"type": "function"}]}, "chat", "tools", "is not supported"),
    ({**CHAT, "logprobs": True}, "chat", "logprobs", "is not supported"),
    ({**COMPLETION, "logprobs": 2}, "completion", "logprobs", "is not supported"),
    ({**COMPLETION, "best_of": 3}, "completion", "best_of", "is not supported"),
    ({**CHAT, "presence_penalty": 0.5}, "chat", "presence_penalty", "is not supported"),
    ({**CHAT, "frobnicate": 1}, "chat", "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({**CHAT, "prompt": "x"}, "chat", "prompt", "Unrecognized request argument"),
    ({**COMPLETION, "messages": []}, "completion", "messages", "Unrecognized request argument"),
    ({"model": "m", "messages": []}, "chat", "messages", "messages must be a non-empty list"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "chat", "messages[0].role",
     "messages[0].role 'wizard' is unknown"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "chat",
     "messages[0].content", "only text is supported"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "chat", "messages[0].content", "must be a string"),
    ({"model": "m", "messages": ["hi"]}, "chat", "messages[0]", "must be an object"),
    ({**COMPLETION, "prompt": ""}, "completion", "prompt", "prompt is empty"),
    ({**COMPLETION, "prompt": ["a", "b"]}, "completion", "prompt", "one prompt"),
    ({**COMPLETION, "prompt": [1, -2]}, "completion", "prompt", "must not be negative"),
    ({**COMPLETION, "prompt": 7}, "completion", "prompt", "non-empty string or a list of token ids"),
    ({**COMPLETION, "max_tokens": 0}, "completion", "max_tokens", "max_tokens must be between 1"),
    ({**COMPLETION, "max_tokens": "8"}, "completion", "max_tokens", "must be an integer"),
    ({**CHAT, "max_completion_tokens": -1}, "chat", "max_completion_tokens", "between 1"),
    ({**COMPLETION, "temperature": 3}, "completion", "temperature", "between 0 and 2"),
    ({**COMPLETION, "temperature": True}, "completion", "temperature", "must be a number"),
    ({**COMPLETION, "top_p": 0}, "completion", "top_p", "greater than 0"),
    ({**COMPLETION, "seed": -1}, "completion", "seed", "between 0"),
    ({**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, "completion", "stop", "at most 4"),
    ({**COMPLETION, "stop": [""]}, "completion", "stop", "non-empty"),
    ({**COMPLETION, "stream": "yes"}, "completion", "stream", "true or false"),
    ({**COMPLETION, "stream_options": {"include_usage": True}}, "completion", "stream_options",
     "only allowed with stream: true"),
    ({**COMPLETION, "stream": True, "stream_options": {"x": 1}}, "completion", "stream_options", "only hold"),
])
def test_bad_fields_are_400_naming_the_field(body, kind, param, message):
    with pytest.raises(ApiError) as e:
        parse_call([1] if body == "[1]" else body, kind)
    assert e.value.status == 400 and e.value.param == param and message in str(e.value)
    assert e.value.body()["error"] == {"message": str(e.value), "type": "invalid_request_error",
                                       "param": param, "code": None}


def test_answers_have_openais_shape():
    usage = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
    chat = Answer("chat", "r1", "m", include_usage=True, clock=lambda: 5)
    assert chat.delta("a")["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    second = chat.delta("b", "stop")
    assert second["choices"][0] | {} == {"index": 0, "delta": {"content": "b"}, "finish_reason": "stop", "logprobs": None}
    assert second["usage"] is None and second["object"] == "chat.completion.chunk" and second["id"] == "chatcmpl-r1"
    last = chat.usage_chunk(usage)
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8}}
    whole = Answer("completion", "r2", "m", clock=lambda: 5).complete("xyz", "length", usage)
    assert whole == {"id": "cmpl-r2", "object": "text_completion", "created": 5, "model": "m",
                     "choices": [{"index": 0, "text": "xyz", "finish_reason": "length", "logprobs": None}],
                     "usage": usage.body()}
    assert "usage" not in Answer("completion", "r3", "m").delta("x")
