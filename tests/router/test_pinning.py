"""A request's pin at both doors, and the pin the router makes: the salted chain its lookups ask
about, a refusal as the request's answer, an unreachable block_service as a warning."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.errors import ResourceExhausted, Unavailable
from kvfleet.core.tenants import Tenant
from kvfleet.core.wire import InvalidRequest
from kvfleet.router.http_door import generate_request
from kvfleet.router.openai_requests import ApiError, parse_call
from kvfleet.router.openai_responses import Usage
from kvfleet.router.pinning import DEFAULT_TTL_S, MAX_TTL_S, PinAsk, PinRefused, pin_from_proto, pin_prompt
from kvfleet.router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.v1 import inference_pb2

COMPLETION = {"model": "m", "prompt": "hi"}


def test_kvfleet_pin_is_true_or_an_object_and_reaches_the_generate_request():
    assert parse_call(COMPLETION, "completion").pin is None
    assert parse_call({**COMPLETION, "kvfleet_pin": True}, "completion").pin == PinAsk(0, DEFAULT_TTL_S)
    call = parse_call({**COMPLETION, "kvfleet_pin": {"tokens": 64, "ttl_s": 60}}, "completion")
    assert call.pin == PinAsk(64, 60)
    req = generate_request(call)
    assert (req.cache.pin, req.cache.pin_tokens, req.cache.pin_ttl_s) == (True, 64, 60)
    assert pin_from_proto(req) == PinAsk(64, 60)
    assert not generate_request(parse_call(COMPLETION, "completion")).HasField("cache")


@pytest.mark.parametrize("value, words", [
    ("yes", "kvfleet_pin must be true or an object"),
    (1, "kvfleet_pin must be true or an object"),
    ({"tokens": -1}, "kvfleet_pin.tokens must be a whole number >= 0"),
    ({"ttl_s": 1.5}, "kvfleet_pin.ttl_s must be a whole number >= 0"),
    ({"ttl_s": MAX_TTL_S + 1}, "kvfleet_pin.ttl_s: at most 604800 s"),
    ({"salt": "x"}, "kvfleet_pin may only hold tokens and ttl_s, not salt"),
])
def test_a_bad_kvfleet_pin_is_a_400_naming_it(value, words):
    with pytest.raises(ApiError) as err:
        parse_call({**COMPLETION, "kvfleet_pin": value}, "completion")
    assert err.value.status == 400 and err.value.param == "kvfleet_pin" and words in str(err.value)


def test_cache_options_on_the_grpc_door():
    req = inference_pb2.GenerateRequest()
    assert pin_from_proto(req) is None
    req.cache.pin_ttl_s = 5
    with pytest.raises(InvalidRequest, match="need cache.pin: true"):
        pin_from_proto(req)
    req.cache.pin = True
    assert pin_from_proto(req) == PinAsk(0, 5)
    req.cache.pin_ttl_s = MAX_TTL_S + 1
    with pytest.raises(InvalidRequest, match="cache.pin_ttl_s: at most"):
        pin_from_proto(req)


def test_http_usage_names_the_pinned_tokens_only_when_a_pin_was_made():
    assert "kvfleet_pinned_tokens" not in Usage(5, 1, 0).body()
    assert Usage(5, 1, 0, 32).body()["kvfleet_pinned_tokens"] == 32


class FakeClient:
    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, []

    async def pin_prefix(self, node_id, tenant, hashes, ttl_s):
        self.calls.append((node_id, tenant, hashes, ttl_s))
        if self.error is not None:
            raise self.error


NODE = SimpleNamespace(node_id="n0", info=SimpleNamespace(block_size=16))
PROMPT = list(range(40))  # two full blocks and a part


def test_the_router_pins_the_chain_its_lookups_ask_about_salted_with_the_group():
    client = FakeClient()
    lookup = BlockServicePrefixLookup(client)
    tenant = Tenant("gold", prefix_group="org")
    assert asyncio.run(pin_prompt(lookup, PinAsk(0, 60), tenant, PROMPT, NODE)) == 32
    [(node, name, hashes, ttl)] = client.calls
    assert (node, name, ttl) == ("n0", "gold", 60)
    assert hashes == block_hashes(PROMPT, 16, tenant_extra_key("gold", False, "org")) and len(hashes) == 2
    assert asyncio.run(pin_prompt(lookup, PinAsk(20, 60), tenant, PROMPT, NODE)) == 16  # pin_tokens: whole blocks
    assert asyncio.run(pin_prompt(lookup, PinAsk(10, 60), tenant, PROMPT, NODE)) == 0   # less than a block
    assert len(client.calls) == 2


def test_a_refusal_is_the_answer_and_an_unreachable_block_service_a_warning(caplog):
    tenant = Tenant("gold")
    lookup = BlockServicePrefixLookup(FakeClient(ResourceExhausted("tenant 'gold' may pin 1 blocks ...")))
    with pytest.raises(PinRefused) as err:
        asyncio.run(pin_prompt(lookup, PinAsk(0, 60), tenant, PROMPT, NODE))
    assert err.value.code == "RESOURCE_EXHAUSTED" and "may pin 1 blocks" in str(err.value)
    lookup = BlockServicePrefixLookup(FakeClient(Unavailable("block_service is down")))
    with caplog.at_level(logging.WARNING, logger="kvfleet.router.pinning"):
        assert asyncio.run(pin_prompt(lookup, PinAsk(0, 60), tenant, PROMPT, NODE)) == 0
    assert "pin of 2 blocks on node n0 not made" in caplog.text and "served unpinned" in caplog.text
