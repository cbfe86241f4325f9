"""A request's ``cache.pin``: what it asks (checked at either door) and the pin the router makes on the
node it chose, before it dispatches.

    GenerateRequest.cache {pin, pin_tokens, pin_ttl_s}    (gRPC)
    "kvfleet_pin": true | {"tokens": N, "ttl_s": S}      (the OpenAI door)

The router hashes the prompt's leading full blocks (all of them, or those within ``pin_tokens``)
exactly as its prefix lookups do — the tenant's chain, salted with its prefix group when it has one
(``BlockServicePrefixLookup.hashes``) — and asks block_service to pin them on the chosen node
(``PinPrefix``) for ``pin_ttl_s`` (default ``DEFAULT_TTL_S``, at most ``MAX_TTL_S``). Pinned
before the prompt runs, the blocks are held from the moment the node caches them.

A refusal is the request's answer, and nothing else happens (no node runs it): past the tenant's
budget ``RESOURCE_EXHAUSTED`` (HTTP 429), no budget ``FAILED_PRECONDITION`` (HTTP 400), each with
block_service's one line. A pin is a cache hint, so a block_service that cannot be reached (or does
not know the node yet) is no reason to fail the request: it is served unpinned and a WARNING says
so; ``Usage.pinned_tokens`` (HTTP: ``usage.kvfleet_pinned_tokens``) tells the client how many of its
prompt tokens the pin covers — 0 when it was not made. A request resumed or retried on another
node keeps the pin it made on the first one (a pin is per node).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvfleet.block_service.pins import DEFAULT_TTL_S, MAX_TTL_S
from kvfleet.core.backoff import error_line
from kvfleet.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from kvfleet.core.run_to_end import run_to_end
from kvfleet.core.wire import InvalidRequest

log = logging.getLogger(__name__)

REFUSED = (ResourceExhausted, FailedPrecondition, InvalidArgument, PermissionDenied)  # the client's answers


@dataclass(slots=True, frozen=True)
class PinAsk:
    tokens: int  # the leading prompt tokens to pin (whole blocks of them); 0: every full block
    ttl_s: int


def _ttl(ttl_s: int) -> int:
    if ttl_s > MAX_TTL_S:
        raise ValueError(f"at most {MAX_TTL_S} s (7 days), got {ttl_s}")
    return ttl_s or DEFAULT_TTL_S


def pin_from_proto(req) -> PinAsk | None:
    """A ``GenerateRequest``'s ``cache``: None unless it asks to pin; ``InvalidRequest`` for a bad ttl."""
    if not req.HasField("cache") or not req.cache.pin:
        if req.HasField("cache") and (req.cache.pin_tokens or req.cache.pin_ttl_s):
            raise InvalidRequest("cache.pin_tokens and cache.pin_ttl_s need cache.pin: true")
        return None
    try:
        return PinAsk(req.cache.pin_tokens, _ttl(req.cache.pin_ttl_s))
    except ValueError as e:
        raise InvalidRequest(f"cache.pin_ttl_s: {e}") from None


def pin_from_json(value) -> PinAsk | None:
    """The OpenAI door's ``kvfleet_pin``: ``true``, ``false``/null, or ``{"tokens": N, "ttl_s": S}``
    (both optional, whole numbers >= 0); ``ValueError`` saying what is wrong otherwise."""
    if value is None or value is False:
        return None
    if value is True:
        return PinAsk(0, DEFAULT_TTL_S)
    if not isinstance(value, dict):
        raise ValueError(f'kvfleet_pin must be true or an object {{"tokens": N, "ttl_s": S}}, got {value!r:.60}')
    extra = set(value) - {"tokens", "ttl_s"}
    if extra:
        raise ValueError(f"kvfleet_pin may only hold tokens and ttl_s, not {', '.join(sorted(extra))}")
    got = {}
    for name in ("tokens", "ttl_s"):
        v = value.get(name, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 32:
            raise ValueError(f"kvfleet_pin.{name} must be a whole number >= 0, got {v!r:.40}")
        got[name] = v
    try:
        return PinAsk(got["tokens"], _ttl(got["ttl_s"]))
    except ValueError as e:
        raise ValueError(f"kvfleet_pin.ttl_s: {e}") from None


def set_cache(req, ask: PinAsk | None) -> None:
    """``ask`` into a ``GenerateRequest`` (the OpenAI door's mapping)."""
    if ask is not None:
        req.cache.pin, req.cache.pin_tokens, req.cache.pin_ttl_s = True, ask.tokens, ask.ttl_s


class PinRefused(Exception):
    """block_service refused the pin: the request's answer (``code``: its gRPC status name)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


async def pin_prompt(prefix, ask: PinAsk, tenant, prompt_ids, node) -> int:
    """Pin the prompt's leading full blocks on ``node``; the tokens pinned (0: not made, said in a
    WARNING). Raises ``PinRefused`` when block_service refuses it."""
    client = getattr(prefix, "client", None)
    hashes_of = getattr(prefix, "hashes", None)
    if client is None or hashes_of is None:
        log.warning("tenant %s asked to pin a prompt but this router has no block_service: served unpinned",
                    tenant.name)
        return 0
    bs = node.info.block_size
    ids = prompt_ids if not ask.tokens else prompt_ids[:ask.tokens]
    hashes = hashes_of(tenant.name, ids, bs, tenant.prefix_group or "")
    if not hashes:
        return 0  # shorter than one block: nothing to pin
    try:
        await run_to_end(client.pin_prefix(node.node_id, tenant.name, hashes, ask.ttl_s))  # see kvfleet.core.run_to_end
    except REFUSED as e:
        raise PinRefused(e.code, str(e)) from None
    except Exception as e:
        log.warning("tenant %s: pin of %d blocks on node %s not made (%s); served unpinned", tenant.name,
                    len(hashes), node.node_id, error_line(e))
        return 0
    return len(hashes) * bs
