"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` bodies checked and mapped to what the
public ``GenerateRequest`` says. Pure: JSON in, a dataclass out, or an ``ApiError`` naming the field.

    {"model", "prompt" | "messages", "max_tokens", "temperature", ...}  →  OpenAICall
        prompt: text, or token ids                   →  GenerateRequest.text | .tokens
        messages: [{role, content}]                  →  GenerateRequest.chat
        max_tokens | max_completion_tokens, temperature, top_p, seed, stop (+ top_k, ignore_eos)
                                                     →  GenerateRequest.sampling

What kvfleet does not do (several choices, tools, log probabilities, penalties, ...) is refused
with 400 rather than ignored: a client must not believe it got what it asked for. Unknown fields
are refused as OpenAI refuses them. ``top_k`` and ``ignore_eos`` are accepted as vLLM accepts them,
and kvfleet's own ``kvfleet_pin`` (``true`` or ``{"tokens": N, "ttl_s": S}``: ``kvfleet/router/pinning.py``);
vLLM's ``cache_salt`` is refused with its own line: the salt is decided from the API key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.core.sampling import SamplingParams
from kvfleet.router.chat_template import ROLES, ChatMessage
from kvfleet.router.pinning import PinAsk, pin_from_json

DEFAULT_MAX_TOKENS = 16        # OpenAI's default for completions
MAX_MAX_TOKENS = 1 << 20
MAX_STOP = 4                   # OpenAI's limit on stop sequences

# accepted when they ask for nothing kvfleet does not do: field → the values that mean "off"
NEUTRAL = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,), "suffix": (None, ""), "tools": (None,), "tool_choice": (None, "none"),
    "functions": (None,), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}
IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort", "web_search_options")
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "top_k", "ignore_eos", "prompt_cache_key", "kvfleet_pin", *IGNORED, *NEUTRAL)
FIELDS = {"completion": {"prompt", *COMMON}, "chat": {"messages", "max_completion_tokens", *COMMON}}


class ApiError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclass(slots=True, frozen=True)
class OpenAICall:
    kind: str                                   # "completion" | "chat"
    model: str
    sampling: SamplingParams
    text: str | None = None                     # completion: a prompt string
    token_ids: tuple[int, ...] | None = None    # completion: a prompt of token ids
    messages: tuple[ChatMessage, ...] = field(default_factory=tuple)  # chat
    stream: bool = False
    include_usage: bool = False                 # stream_options.include_usage
    conversation: str = ""                      # prompt_cache_key, else user: keeps a canary split sticky
    pin: PinAsk | None = None                   # kvfleet_pin: GenerateRequest.cache (``kvfleet/router/pinning.py``)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise bad(name, f"{name} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise bad(name, f"{name} must be between {low} and {high}, got {value!r}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP:
        raise bad("stop", f"stop takes at most {MAX_STOP} sequences, got {len(stop)}")
    return tuple(stop)


def _sampling(body: dict, kind: str) -> SamplingParams:
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    name = next((n for n in names if body.get(n) is not None), names[-1])
    max_tokens = _integer(body, name, None, 1, MAX_MAX_TOKENS)
    if max_tokens is None:  # chat: until the end of the turn (bounded by the model's length)
        max_tokens = DEFAULT_MAX_TOKENS if kind == "completion" else MAX_MAX_TOKENS
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "top_p must be greater than 0")
    try:  # seed 0 is none, as on the public API (proto3 cannot tell it from unset)
        return SamplingParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=top_p, top_k=max(_integer(body, "top_k", 0, -1, 1 << 30), 0),
                              seed=_integer(body, "seed", 0, 0, 2**63 - 1) or None, stop=_stop(body),
                              ignore_eos=_flag(body, "ignore_eos"))
    except ValueError as e:  # a limit of the sampling parameters themselves (a stop string's length)
        raise ApiError(400, str(e)) from None


# vLLM's per-request prefix-cache salt: kvfleet's salt is the router's decision, never the client's
CACHE_SALT_REFUSED = ("cache_salt is not taken from clients: kvfleet salts a request's cached prefixes by its "
                      "API key's tenant (or that tenant's prefix_group in the tenants file)")


def _check_fields(body: dict, kind: str) -> None:
    if "cache_salt" in body:
        raise bad("cache_salt", CACHE_SALT_REFUSED)
    for name in body:
        if name not in FIELDS[kind]:
            raise bad(name, f"Unrecognized request argument supplied: {name}")
    for name, neutral in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise bad(name, f"{name}={body[name]!r} is not supported by kvfleet")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: the id that GET /v1/models lists")


def _prompt(body: dict) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad("prompt", "prompt token ids must not be negative")
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "prompt must be one prompt: kvfleet serves one choice per request")
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids")


def _content(value, where: str) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content", f"{where}.content[{j}] must be a text part "
                                              "({\"type\": \"text\", \"text\": ...}); only text is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def _messages(body: dict) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role {role!r} is unknown; use one of {', '.join(ROLES)}")
        if m.get("tool_calls"):
            raise bad(f"{where}.tool_calls", "tool calls are not supported by kvfleet")
        out.append(ChatMessage(role, _content(m.get("content"), where)))
    return tuple(out)


def _conversation(body: dict) -> str:
    """The client's conversation id: ``prompt_cache_key``, else ``user`` (strings; "" when neither)."""
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad(name, f"{name} must be a string")
        if value:
            return value
    return ""


def _pin(body: dict) -> PinAsk | None:
    try:
        return pin_from_json(body.get("kvfleet_pin"))
    except ValueError as e:
        raise bad("kvfleet_pin", str(e)) from None


def parse_call(body, kind: str) -> OpenAICall:
    """Check a decoded JSON body of ``kind`` ("completion" or "chat"); raises ``ApiError``."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, kind)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", "stream_options may only hold include_usage")
    stream = _flag(body, "stream")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    call = dict(kind=kind, model=body["model"], sampling=_sampling(body, kind), stream=stream,
                include_usage=_flag(options or {}, "include_usage"), conversation=_conversation(body),
                pin=_pin(body))
    if kind == "chat":
        return OpenAICall(messages=_messages(body), **call)
    text, token_ids = _prompt(body)
    return OpenAICall(text=text, token_ids=token_ids, **call)
