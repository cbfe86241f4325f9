"""GenerateRequest → ParsedRequest: every bad field is an InvalidRequest naming it."""

import re

import pytest

from kvfleet.core.ids import MAX_REQUEST_ID_LEN, SEQ_SUFFIX_LEN, check_id
from kvfleet.core.wire import InvalidRequest, sampling_from_proto, sampling_to_proto
from kvfleet.router.request import ModelVocabulary, parse_request
from kvfleet.v1 import inference_pb2


class ByteTokenizer:
    vocab_size = 260

    def encode(self, text):
        return list(text.encode())


def req(**kw):
    sampling = kw.pop("sampling", dict(max_tokens=4))
    r = inference_pb2.GenerateRequest(**kw)
    if sampling is not None:
        r.sampling.CopyFrom(inference_pb2.SamplingParams(**sampling))
    return r


def test_text_and_tokens():
    p = parse_request(req(text="hi", request_id="r1"), ByteTokenizer())
    assert (p.request_id, p.prompt_ids, p.sampling.max_tokens) == ("r1", [104, 105], 4)
    assert p.seq_id.startswith("r1-") and p.seq_id != parse_request(req(text="hi", request_id="r1"), ByteTokenizer()).seq_id
    p = parse_request(req(tokens=inference_pb2.TokenIds(ids=[1, 2, 259])), ByteTokenizer())
    assert p.prompt_ids == [1, 2, 259] and len(p.request_id) == 32  # generated


def test_the_models_vocabulary_bounds_prompt_ids():
    """A model embedding more ids than its tokenizer makes (301 > 260) takes them; one that embeds
    fewer refuses a text whose tokens it has no embedding for."""
    p = parse_request(req(tokens=inference_pb2.TokenIds(ids=[1, 265, 300])), ModelVocabulary(ByteTokenizer(), 301))
    assert p.prompt_ids == [1, 265, 300]
    with pytest.raises(InvalidRequest, match="token id 301 is outside the vocabulary"):
        parse_request(req(tokens=inference_pb2.TokenIds(ids=[301])), ModelVocabulary(ByteTokenizer(), 301))
    with pytest.raises(InvalidRequest, match="token id 195 is outside the vocabulary .0, 128."):
        parse_request(req(text="\xff"), ModelVocabulary(ByteTokenizer(), 128))


def test_zero_means_off():
    s = sampling_from_proto(inference_pb2.SamplingParams(max_tokens=3, top_p=0, seed=0))
    assert (s.top_p, s.seed, s.greedy) == (1.0, None, True)
    message = inference_pb2.SamplingParams()
    sampling_to_proto(sampling_from_proto(inference_pb2.SamplingParams(max_tokens=3, temperature=0.5, seed=7,
                                                                       stop=["x"], top_k=5)), message)
    assert (message.max_tokens, message.seed, list(message.stop), message.top_k) == (3, 7, ["x"], 5)


@pytest.mark.parametrize("r, words", [
    (req(), "prompt is missing"),
    (req(text=""), "prompt text is empty"),
    (req(tokens=inference_pb2.TokenIds(ids=[])), "prompt tokens are empty"),
    (req(tokens=inference_pb2.TokenIds(ids=[300])), "outside the vocabulary"),
    (req(text="x", sampling=None), "sampling is missing"),
    (req(text="x", sampling=dict(max_tokens=0)), "max_tokens"),
    (req(text="x", sampling=dict(max_tokens=1, temperature=-0.5)), "temperature"),
    (req(text="x", sampling=dict(max_tokens=1, temperature=float("nan"))), "temperature"),
    (req(text="x", sampling=dict(max_tokens=1, top_p=1.5)), "top_p"),
    (req(text="x", sampling=dict(max_tokens=1, stop=[""])), "stop"),
    (req(text="x", request_id="a" * (MAX_REQUEST_ID_LEN + 1)), "request_id"),
    (req(text="x", request_id="bad\nid"), "request_id"),
])
def test_bad_fields(r, words):
    with pytest.raises(InvalidRequest, match=None) as info:
        parse_request(r, ByteTokenizer())
    assert words in str(info.value)


def test_longest_request_id_makes_a_sequence_id_block_service_takes():
    p = parse_request(req(text="x", request_id="a" * MAX_REQUEST_ID_LEN), ByteTokenizer())
    assert len(p.seq_id) == MAX_REQUEST_ID_LEN + SEQ_SUFFIX_LEN and check_id("seq_id", p.seq_id) == p.seq_id


def test_negative_top_p_is_refused_not_disabled():
    with pytest.raises(InvalidRequest, match="top_p"):
        parse_request(req(text="x", sampling=dict(max_tokens=1, top_p=-0.5)), ByteTokenizer())


def test_chat_is_rendered_by_the_models_template_and_stops_at_its_end_of_turn():
    from kvfleet.cli.model_maker import CHAT_TEMPLATE
    from kvfleet.router.chat_template import ChatTemplate

    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="你好")])
    p = parse_request(req(chat=chat), ByteTokenizer(), template, frozenset({257}))
    assert p.prompt_ids == list("<s>user\n你好</s>\n<s>assistant\n".encode())
    assert p.stop_token_ids == {257}
    ignoring = parse_request(req(chat=chat, sampling=dict(max_tokens=4, ignore_eos=True)), ByteTokenizer(),
                             template, frozenset({257}))
    assert ignoring.stop_token_ids == frozenset()
    for bad, error in [(inference_pb2.ChatMessages(), "chat.messages is empty"),
                       (inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="bot", content="x")]),
                        "chat.messages[0].role 'bot' is unknown")]:
        with pytest.raises(InvalidRequest, match=re.escape(error)):
            parse_request(req(chat=bad), ByteTokenizer(), template)
    with pytest.raises(InvalidRequest, match="no chat template"):
        parse_request(req(chat=chat), ByteTokenizer())
