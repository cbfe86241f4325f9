"""Requests a careless or hostile client sends, each with the answers the contract allows it:

    bad_field_cases()     one field wrong at a time → INVALID_ARGUMENT (docs/design.md "Errors are answers")
    auth_cases()          missing, wrong, malformed or doubled credentials → UNAUTHENTICATED
    same_id_cases()       one request_id twice at once → one runs, the other ALREADY_EXISTS
    mutated_cases(rng)    a valid request with random fields set to edge values → OK or INVALID_ARGUMENT
    undecodable(rng)      bytes that are no GenerateRequest at all → INVALID_ARGUMENT

A case is ``(label, spec, request, metadata)``: ``send`` takes them as they are.
"""

from __future__ import annotations

import math
import random

from chaos_load import bearer
from chaos_outcomes import OK, RequestSpec
from google.protobuf.message import DecodeError

from kvfleet.core.ids import MAX_REQUEST_ID_LEN
from kvfleet.v1 import inference_pb2

INVALID = frozenset({"INVALID_ARGUMENT"})
UNAUTH = frozenset({"UNAUTHENTICATED"})
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings


def _request(tokens=(1, 2, 3, 4, 5), max_tokens=4, **sampling) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    req.tokens.ids.extend(tokens)
    return req


def _case(label: str, req, allowed=INVALID, metadata=None):
    spec = RequestSpec(f"fuzz: {label}", "sk-gold", "", 0, allowed)
    return spec, req, metadata if metadata is not None else bearer("sk-gold")


def bad_field_cases() -> list[tuple]:
    no_prompt = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(max_tokens=4))
    empty_text = inference_pb2.GenerateRequest(text="", sampling=inference_pb2.SamplingParams(max_tokens=4))
    empty_tokens = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(),
                                                 sampling=inference_pb2.SamplingParams(max_tokens=4))
    no_sampling = _request()
    no_sampling.ClearField("sampling")
    long_id, odd_id = _request(), _request()
    long_id.request_id = "r" * (MAX_REQUEST_ID_LEN + 1)
    odd_id.request_id = "bad\x00id"
    return [
        _case("no prompt", no_prompt),
        _case("empty text", empty_text),
        _case("empty tokens", empty_tokens),
        _case("token outside the vocabulary", _request(tokens=(1, 2, 10**6))),
        _case("prompt longer than the model", _request(tokens=[7] * (MAX_MODEL_LEN + 8))),
        _case("no sampling", no_sampling),
        _case("max_tokens 0", _request(max_tokens=0)),
        _case("negative temperature", _request(temperature=-1.0)),
        _case("NaN temperature", _request(temperature=math.nan)),
        _case("infinite temperature", _request(temperature=math.inf)),
        _case("top_p above 1", _request(top_p=1.5)),
        _case("negative top_p", _request(top_p=-0.5)),
        _case("17 stop strings", _request(stop=[f"s{i}" for i in range(17)])),
        _case("empty stop string", _request(stop=[""])),
        _case("stop string too long", _request(stop=["x" * 300])),
        _case("request_id too long", long_id),
        _case("request_id not printable", odd_id),
    ]


def same_id_cases() -> list[tuple]:
    """Two calls with one request_id sent together: the second finds the first running
    (inference.proto: "idempotency key, per tenant: ALREADY_EXISTS while a call with it runs")."""
    req = _request(max_tokens=64)
    req.request_id = "chaos-same-id"
    return [_case("same request_id", req, frozenset({OK, "ALREADY_EXISTS"})) for _ in range(2)]


def auth_cases() -> list[tuple]:
    req = _request()
    return [
        _case("no credentials", req, UNAUTH, []),
        _case("unknown key", req, UNAUTH, bearer("sk-nobody")),
        _case("empty bearer", req, UNAUTH, [("authorization", "Bearer ")]),
        _case("not a bearer", req, UNAUTH, [("authorization", "Basic sk-gold")]),
        # the last header must not silently win; ambiguous credentials are refused
        _case("two authorization headers", req, UNAUTH | INVALID,
              [("authorization", "Bearer sk-free"), ("authorization", "Bearer sk-gold")]),
    ]


EDGE_VALUES = {
    "max_tokens": (0, 1, 7),
    "temperature": (0.0, -0.0, 1e-30, 0.7, -2.0, math.nan, math.inf, 1e30),
    "top_p": (0.0, 1e-9, 0.5, 1.0, 1.0000001, -1.0, math.nan),
    "top_k": (0, 1, 50, 2**32 - 1),
    "seed": (0, 1, 2**64 - 1),
    "stop": ((), ("a",), ("",), ("x" * 257,), tuple(str(i) for i in range(20))),
    "request_id": ("", "a", "\u00e9\u4e2d", "x" * MAX_REQUEST_ID_LEN, "x" * (MAX_REQUEST_ID_LEN + 1), "\t"),
}


def mutated_cases(rng: random.Random, count: int) -> list[tuple]:
    """Valid requests with one to three fields set to edge values; whether each is valid is for the
    router to say, but only OK or INVALID_ARGUMENT are answers."""
    cases = []
    for i in range(count):
        req = _request(tokens=[rng.randrange(256) for _ in range(rng.randint(1, 40))])
        for name in rng.sample(sorted(EDGE_VALUES), rng.randint(1, 3)):
            value = rng.choice(EDGE_VALUES[name])
            if name == "request_id":
                req.request_id = value
            elif name == "stop":
                req.sampling.stop[:] = list(value)
            else:
                setattr(req.sampling, name, value)
        # fields set at random to the same request_id may run at once: the later ones ALREADY_EXISTS
        allowed = frozenset({OK, "ALREADY_EXISTS"} if req.request_id else {OK}) | INVALID
        cases.append(_case(f"mutated #{i}", req, allowed))
    return cases


def valid_payload() -> bytes:
    """A well-formed request's bytes: the control for the raw path."""
    return _request(tokens=list(range(40)), max_tokens=4).SerializeToString()


def undecodable(rng: random.Random, count: int) -> list[bytes]:
    """Payloads that do not parse as a GenerateRequest (checked here with the same protobuf)."""
    valid = valid_payload()
    payloads = [
        b"\xff" * 12,                        # a tag varint longer than ten bytes
        b"\x0a\xff\x01abc",                  # request_id claims 255 bytes, has 3
        b"\x0f",                             # wire type 7 does not exist
        b"\x00",                             # field number 0
        b"\x12\x02\xff\xfe",                 # text that is not UTF-8
        valid[:-1],                          # a valid request cut short
    ]
    while len(payloads) < count:
        blob = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        try:
            inference_pb2.GenerateRequest.FromString(blob)
        except DecodeError:
            payloads.append(blob)
    for p in payloads:
        try:
            inference_pb2.GenerateRequest.FromString(p)
        except DecodeError:
            continue
        raise AssertionError(f"{p!r} decodes: not a garbage payload")
    return payloads
