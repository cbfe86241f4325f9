"""Chat templates rendered as ``transformers`` renders them, and every bad conversation refused
with a message naming the field."""

from __future__ import annotations

import json

import pytest

from kvfleet.cli.model_maker import CHAT_TEMPLATE, build_tokenizer
from kvfleet.core.wire import InvalidRequest
from kvfleet.router.chat_template import ChatMessage, ChatTemplate, NoChatTemplate, end_of_turn_ids

SMOLLM2 = (  # SmolLM2-Instruct's template: ChatML with a default system prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FANCY = (  # the features transformers gives templates: loop controls, tojson, generation blocks
    "{{ bos_token }}{% for m in messages %}{% if m['content'] == 'skip me' %}{% continue %}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"},
     {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "skip me"},
     {"role": "user", "content": "Und jetzt?"}],
]


def model_dir(tmp_path, template, **config):
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = {**dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                     pad_token="<pad>", unk_token="<unk>"), **config}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def as_messages(conversation):
    return [ChatMessage(m["role"], m["content"]) for m in conversation]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, SMOLLM2, FANCY], ids=["model_maker", "smollm2", "fancy"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "several"])
def test_renders_as_transformers_does(tmp_path, template, conversation):
    from transformers import AutoTokenizer

    path = model_dir(tmp_path, template)
    expected = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_model_dir(path).render(as_messages(conversation)) == expected


def test_template_file_wins_and_named_templates_pick_default(tmp_path):
    path = model_dir(tmp_path, [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "A"}])
    assert ChatTemplate.from_model_dir(path).render(as_messages(CONVERSATIONS[0])) == "A"
    (path / "chat_template.jinja").write_text("B{{ messages | length }}")
    assert ChatTemplate.from_model_dir(path).render(as_messages(CONVERSATIONS[0])) == "B1"


@pytest.mark.parametrize("messages, error", [
    ([], "chat.messages is empty"),
    ([ChatMessage("user", "hi"), ChatMessage("wizard", "hi")], "chat.messages[1].role 'wizard' is unknown"),
    ([ChatMessage("user", "hi"), ChatMessage("system", "late")], "refuses them: a system message must come first"),
])
def test_bad_conversations_name_the_field(tmp_path, messages, error):
    template = ChatTemplate.from_model_dir(model_dir(tmp_path, CHAT_TEMPLATE))
    with pytest.raises(InvalidRequest) as e:
        template.render(messages)
    assert error in str(e.value)


def test_a_model_without_a_template_refuses_chat(tmp_path):
    template = ChatTemplate.from_model_dir(model_dir(tmp_path, None))
    assert not template.available
    with pytest.raises(NoChatTemplate, match="chat: this model has no chat template"):
        template.render(as_messages(CONVERSATIONS[0]))


def test_a_template_error_on_the_messages_is_the_clients(tmp_path):
    template = ChatTemplate.from_model_dir(model_dir(tmp_path, "{{ messages[0]['content'] + 1 }}"))
    with pytest.raises(InvalidRequest, match="chat.messages: the model's chat template failed"):
        template.render(as_messages(CONVERSATIONS[0]))


def test_end_of_turn_ids_gather_config_generation_config_and_tokenizer_eos(tmp_path):
    path = model_dir(tmp_path, CHAT_TEMPLATE, eos_token={"content": "<pad>", "special": True})
    (path / "config.json").write_text(json.dumps({"eos_token_id": 257}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))
    ids = {"<pad>": 258}
    assert end_of_turn_ids(path, ids.get) == {257, 258, 259}
    assert end_of_turn_ids(tmp_path / "nowhere", ids.get) == frozenset()
