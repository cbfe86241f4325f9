"""Clients as a service meets them: cancelling early and late, a small tenant flooding its quota
next to a paying one, fuzzed fields and undecodable bytes, each next to ordinary streams. Nothing
is killed here: every process must live through it (the checker compares pids), and the shared
checker judges the rest (health, a token-exact probe, no leaked block, durable invariants,
statuses, tokens).
"""

from __future__ import annotations

import asyncio
import random

import grpc
from chaos_checker import report
from chaos_cluster import SMALL_QUOTA_TOKENS
from chaos_fuzz import (
    auth_cases,
    bad_field_cases,
    mutated_cases,
    same_id_cases,
    undecodable,
    valid_payload,
)
from chaos_load import LoadGenerator, send, send_raw
from chaos_outcomes import NO_FAULT, OK, RequestSpec, Tally

from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ROUTER_ID, Identity
from kvfleet.v1 import compute_pb2, compute_pb2_grpc, inference_pb2_grpc

FLOOD_TOKENS = 200
PROMPTS = {
    **{f"p{i}": (length, 160) for i, length in enumerate((17, 40, 75, 110))},
    # the small tenant's long requests: each fits its quota alone (prompt + 200 <= 512 - a block) ...
    **{f"f{i}": (length, FLOOD_TOKENS) for i, length in enumerate((120, 170, 200, 230))},
    # ... but this one never does (250 + 400 > 512): refused once it outgrows the quota
    "huge": (250, 400),
}
STREAMS = [RequestSpec("stream", key, f"p{i}", 160) for key in ("sk-gold", "sk-free") for i in range(4)]
INVALID = frozenset({"INVALID_ARGUMENT"})


def _run(cluster, scenario) -> list:
    """``scenario(stub)`` → outcomes, on a channel to the router."""
    async def main():
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            return await scenario(inference_pb2_grpc.InferenceStub(channel), channel)

    return asyncio.run(main())


async def _with_streams(stub, checker, work) -> list:
    """``work`` (an awaitable of outcomes) next to two clients of ordinary streams; all outcomes."""
    streams = LoadGenerator(stub, checker.book, STREAMS, clients=2, seed=7).start()
    try:
        outcomes = list(await work)
    finally:
        outcomes += await streams.stop()
    return outcomes


def _cancelling(cluster, checker, cancels: list[RequestSpec], limit: int, min_cancelled: int) -> list[str]:
    """``limit`` requests drawn from ``cancels`` by six clients next to ordinary streams; the
    checker's findings once they have ended."""
    async def scenario(stub, _):
        load = LoadGenerator(stub, checker.book, cancels, clients=6, limit=limit)
        return await _with_streams(stub, checker, load.start().finish())

    outcomes = _run(cluster, scenario)
    tally = Tally()
    tally.add(outcomes)
    assert sum(o.cancelled for o in outcomes) >= min_cancelled, f"too few cancelled to judge:\n{tally.table()}"
    return asyncio.run(checker.check(NO_FAULT, outcomes))


def test_early_cancellations_leak_nothing(cluster, checker):
    """Cancelled 5-80 ms after sending: while the router queues it, the node allocates its first
    blocks, or its prefill runs. Those early blocks used to leak."""
    cancels = [RequestSpec("early-cancel", key, f"p{i}", 160, cancel_after_s=ms / 1000)
               for key in ("sk-gold", "sk-small") for i in range(4) for ms in (5, 12, 20, 35, 50, 65, 80)]
    problems = _cancelling(cluster, checker, cancels, limit=84, min_cancelled=40)
    assert not problems, report(problems)


def test_a_start_and_its_cancel_in_one_message_leak_nothing(cluster, checker):
    """The router writes the commands queued while it was writing in one ``NodeCommands``: a client
    that leaves as its request is dispatched puts the start and the cancel in one message
    (the soak's leaks of a prompt's early blocks). Here they are written to each node's Serve
    stream directly, eight such pairs, then one request that runs to its end: its early allocation
    was asked after theirs, so once it finished, theirs were answered too."""
    prompt = checker.book.prompts["p1"]  # 40 tokens: two full blocks, shared by every pair

    def start(request_id: str, max_tokens: int) -> compute_pb2.NodeCommand:
        request = compute_pb2.ComputeRequest(request_id=request_id, tenant="gold", prompt_token_ids=prompt)
        request.sampling.max_tokens = max_tokens
        request.sampling.ignore_eos = True
        return compute_pb2.NodeCommand(start=request)

    as_router = tls.Credentials.load(certs.identity_dir(cluster.certs.root, ROUTER_ID), ROUTER_ID)

    async def scenario(name: str, port: int) -> None:  # what the router writes, as the router
        async with rpc.channel(f"127.0.0.1:{port}", peer=Identity.node(name), credentials=as_router) as channel:
            call = compute_pb2_grpc.ComputeStub(channel).Serve()
            for i in range(8):
                await call.write(compute_pb2.NodeCommands(commands=[
                    start(f"{name}-pair-{i}", 160), compute_pb2.NodeCommand(cancel=f"{name}-pair-{i}")]))
            await call.write(compute_pb2.NodeCommands(commands=[start(f"{name}-last", 2)]))
            finished = False
            while not finished:
                message = await call.read()
                assert message is not grpc.aio.EOF, "the node ended the stream"
                finished = any(e.request_id == f"{name}-last" and (e.HasField("error") or e.chunk.finish_reason)
                               for e in message.events)
            await call.done_writing()

    for name, child in cluster.nodes.items():
        asyncio.run(scenario(name, child.port))
    problems = asyncio.run(checker.check(NO_FAULT, []))
    assert not problems, report(problems)


def test_late_cancellations_leak_nothing(cluster, checker):
    """Cancelled mid-stream, after 1 to 90 of 160 tokens: the node aborts it and frees its blocks."""
    cancels = [RequestSpec("late-cancel", key, f"p{i}", 160, cancel_after_tokens=n)
               for key in ("sk-gold", "sk-small") for i in range(4) for n in (1, 8, 30, 90)]
    problems = _cancelling(cluster, checker, cancels, limit=36, min_cancelled=20)
    assert not problems, report(problems)


def test_small_quota_tenant_flooding_next_to_a_paying_one(cluster, checker):
    """14 concurrent long requests of a tenant whose quota holds two of them per node (issue 11
    item 1: a refused top-up near the quota killed the node's step thread). A request that fits
    the quota alone is held back or preempted until it fits, and finishes; one that never fits is
    refused with RESOURCE_EXHAUSTED (the tokens before that exact)."""
    flood = [RequestSpec("flood", "sk-small", f"f{i}", FLOOD_TOKENS) for i in range(4)]
    flood.append(RequestSpec("flood-over-quota", "sk-small", "huge", 400, frozenset({"RESOURCE_EXHAUSTED"})))
    assert PROMPTS["huge"][0] + 400 > SMALL_QUOTA_TOKENS >= max(PROMPTS[s.prompt][0] for s in flood[:4]) + FLOOD_TOKENS

    async def scenario(stub, _):
        load = LoadGenerator(stub, checker.book, flood, clients=14, limit=16)
        return await _with_streams(stub, checker, load.start().finish())

    outcomes = _run(cluster, scenario)
    problems = asyncio.run(checker.check(NO_FAULT, outcomes))
    assert not problems, report(problems)


def _router_tracebacks(cluster) -> int:
    return cluster.router.log_path.read_text(errors="replace").count("Traceback")


def test_fuzzed_fields_and_credentials_get_their_status(cluster, checker):
    rng = random.Random(11)
    cases = same_id_cases() + bad_field_cases() + auth_cases() + mutated_cases(rng, 120)
    tracebacks = _router_tracebacks(cluster)

    async def scenario(stub, _):
        return await _with_streams(stub, checker, asyncio.gather(
            *(send(stub, spec, request=req, metadata=md) for spec, req, md in cases)))

    outcomes = _run(cluster, scenario)
    problems = asyncio.run(checker.check(NO_FAULT, outcomes))
    if (new := _router_tracebacks(cluster) - tracebacks) > 0:
        problems.append(f"the router logged {new} tracebacks for bad requests")
    same_id = sorted(o.code for o in outcomes if o.spec.kind == "fuzz: same request_id")
    if same_id != ["ALREADY_EXISTS", "OK"]:
        problems.append(f"two calls with one request_id at once ended {same_id}, not one OK and one ALREADY_EXISTS")
    assert not problems, report(problems)


def test_undecodable_bytes_get_invalid_argument(cluster, checker):
    """grpcio's default deserializer answered UNKNOWN, with a traceback in the
    router's log for each; a valid request sent the same raw way is the control."""
    payloads = undecodable(random.Random(5), 60)
    tracebacks = _router_tracebacks(cluster)
    garbage = RequestSpec("undecodable", "sk-gold", "", 0, INVALID)
    control = RequestSpec("raw-valid", "sk-gold", "", 0, frozenset({OK}))

    async def scenario(stub, channel):
        sent = [send_raw(channel, p, garbage) for p in payloads] + [send_raw(channel, valid_payload(), control)]
        return await _with_streams(stub, checker, asyncio.gather(*sent))

    outcomes = _run(cluster, scenario)
    problems = asyncio.run(checker.check(NO_FAULT, outcomes))
    if (new := _router_tracebacks(cluster) - tracebacks) > 0:
        problems.append(f"the router logged {new} tracebacks for undecodable requests")
    assert not problems, report(problems)
