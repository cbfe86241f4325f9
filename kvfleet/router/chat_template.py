"""A model's chat template, rendered as Hugging Face ``transformers`` renders it. Pure (jinja2 only).

The template comes from the model directory: a ``chat_template.jinja`` file, else the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used). It is rendered the way ``apply_chat_template`` does, so that a prompt
tokenizes here exactly as it would there:

    ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols)
    globals: raise_exception, strftime_now;  filter: tojson (non-ASCII kept)
    render(messages=[{role, content}], add_generation_prompt=True, bos_token=..., eos_token=..., ...)

What the template or the messages get wrong is the client's mistake (``InvalidRequest`` naming the
field), never a crash of the router.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvfleet.core.wire import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 4096
# the special tokens transformers passes to a template (its special_tokens_map)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(slots=True, frozen=True)
class ChatMessage:
    role: str
    content: str


class NoChatTemplate(InvalidRequest):
    """The model has no chat template: chat requests cannot be rendered for it."""


class TemplateError(Exception):
    """``raise_exception`` called by a template: the conversation breaks the template's rules."""


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _template_source(model_dir: Path, tokenizer_config: dict) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _compile(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
        transformers; rendering a prompt keeps what is inside."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """The chat template of one model directory, compiled once."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = None
        if source is not None:
            try:
                self._template = _compile(source)
            except Exception as e:  # a template that does not even compile is the model's fault
                raise ValueError(f"the model's chat template does not compile: {e}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        return cls(_template_source(model_dir, config), specials)

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened."""
        check_messages(messages)
        if self._template is None:
            raise NoChatTemplate("chat: this model has no chat template (no chat_template in "
                                 "tokenizer_config.json, no chat_template.jinja); send the prompt as text")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True, **self.special_tokens)
        except TemplateError as e:
            raise InvalidRequest(f"chat.messages: the model's chat template refuses them: {e}") from None
        except Exception as e:  # a template error on these messages (e.g. a role it does not know)
            raise InvalidRequest(f"chat.messages: the model's chat template failed on them: {e}") from None


def check_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidRequest("chat.messages is empty: send at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"chat.messages has {len(messages)} messages; at most {MAX_MESSAGES}")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequest(f"chat.messages[{i}].role {m.role!r} is unknown; use one of {', '.join(ROLES)}")
        if not isinstance(m.content, str):
            raise InvalidRequest(f"chat.messages[{i}].content must be a string")


def end_of_turn_ids(model_dir: str | Path, token_id) -> frozenset[int]:
    """The tokens that end the model's turn, as ``transformers.generate`` stops at them: the eos ids
    of ``config.json`` and ``generation_config.json`` and the tokenizer's eos token
    (``token_id(text)`` → its id or None)."""
    model_dir = Path(model_dir)
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
    eos_text = _token_text(_read_json(model_dir / "tokenizer_config.json").get("eos_token"))
    if eos_text:
        eos_id = token_id(eos_text)
        if eos_id is not None:
            ids.add(eos_id)
    return frozenset(ids)
