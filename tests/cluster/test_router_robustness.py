"""Careless or hostile callers and idle links, against real processes: every service answers
undecodable bytes with INVALID_ARGUMENT and no traceback in its log, the router takes one API key
per call and runs a request id once at a time per tenant, and idle streams outlive keepalive pings.
"""

from __future__ import annotations

import time

import grpc
import pytest
from cluster_helpers import random_prompt, request, stream, tokens_of

from kvfleet.core import certs, keepalive, rpc, tls
from kvfleet.core.identity import BLOCK_SERVICE_ID, ROUTER_ID, Identity
from kvfleet.v1 import inference_pb2_grpc

GARBAGE = b"\xff\xff\xff\xff"  # not a protobuf message of any type: the varint never ends


def _answer_to_garbage(address: str, method: str, kind: str, message: str, peer=None, caller=None
                       ) -> tuple[str, bool]:
    """Call ``method`` with ``GARBAGE`` as its request (bytes passed as they are): the status, and
    whether its details are one line that names the expected ``message`` type. ``peer``: the
    internal service there, called as ``caller`` (an identity that may call the method)."""
    with rpc.sync_channel(address, peer=peer, credentials=caller) as channel:
        try:
            if kind == "unary_unary":
                channel.unary_unary(method)(GARBAGE, timeout=30)
            elif kind == "unary_stream":
                list(channel.unary_stream(method)(GARBAGE, timeout=30))
            else:
                list(channel.stream_stream(method)(iter([GARBAGE]), timeout=30))
        except grpc.RpcError as e:
            return e.code().name, message in e.details() and "\n" not in e.details()
    return "OK", False


def test_undecodable_messages_get_invalid_argument_and_no_traceback(shared_cluster):
    cluster = shared_cluster(1)
    node = cluster.nodes["node-0"]
    def as_(identity):
        return tls.Credentials.load(certs.identity_dir(cluster.certs.root, identity), identity)

    calls = [
        (cluster.router, cluster.router_address, "/kvfleet.v1.Inference/Generate", "unary_stream", "GenerateRequest",
         None, None),
        (node, f"127.0.0.1:{node.port}", "/kvfleet.v1.Compute/Serve", "stream_stream", "NodeCommands",
         Identity.node("node-0"), as_(ROUTER_ID)),
        (cluster.block_service, cluster.block_service_address, "/kvfleet.v1.BlockManager/AllocateMany",
         "unary_unary", "AllocateManyRequest", BLOCK_SERVICE_ID, as_(Identity.node("node-0"))),
    ]
    answers = {method: [_answer_to_garbage(address, method, kind, message, peer, caller) for _ in range(3)]
               for _, address, method, kind, message, peer, caller in calls}
    assert answers == {method: [("INVALID_ARGUMENT", True)] * 3 for _, _, method, *_ in calls}

    assert len(tokens_of(stream(cluster.router_address, request(tokens=[1, 2, 3], max_tokens=4, ignore_eos=True)))) == 4
    for child, *_ in calls:
        log = child.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "Unexpected" not in log, f"{child.name}:\n{child.log_tail()}"


# A client that reads slowly: without BDP probing its stream window stays this small, so the
# router cannot write a long answer ahead of the reader and the call stays running until it reads.
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def test_one_api_key_per_call_and_one_running_call_per_request_id(shared_cluster):
    cluster = shared_cluster(1)
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for keys in (["sk-nope", "sk-gold"], ["sk-gold", "sk-gold"]):  # not the last one, nor a repeated one
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request(text="x"), metadata=[("authorization", f"Bearer {k}") for k in keys],
                                   timeout=60))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "exactly one authorization header" in info.value.details()

    prompt = random_prompt(20, seed=5)
    first_req = request(tokens=prompt, max_tokens=300, ignore_eos=True, request_id="dup-1")
    with grpc.insecure_channel(cluster.router_address, options=SLOW_READER) as channel:
        first = inference_pb2_grpc.InferenceStub(channel).Generate(
            first_req, metadata=[("authorization", "Bearer sk-gold")], timeout=120)
        head = next(first)  # running now, and held running by the unread rest of its answer

        with pytest.raises(grpc.RpcError) as info:
            stream(cluster.router_address, request(tokens=prompt, max_tokens=4, request_id="dup-1"))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "request_id dup-1 is already running" in info.value.details()
        # ids are per tenant: another tenant's dup-1 is another request
        other = stream(cluster.router_address, request(tokens=prompt, max_tokens=4, request_id="dup-1"),
                       api_key="sk-free")
        assert len(tokens_of(other)) == 4

        rest = list(first)
    assert len(tokens_of([head, *rest])) == 300
    again = stream(cluster.router_address, request(tokens=prompt, max_tokens=4, request_id="dup-1"))
    assert len(tokens_of(again)) == 4


def test_idle_streams_outlive_keepalive_pings(start_cluster):
    """Every client pinging each second (the shortest interval allowed): a server that counted
    those pings as strikes would answer GOAWAY "too_many_pings" after the third, breaking the
    router's idle Serve stream and its channel to block_service, and the node's."""
    cluster = start_cluster(1, env={keepalive.ENV_VAR: str(keepalive.MIN_PING_INTERVAL_MS)})
    prompt = random_prompt(20, seed=8)
    first = stream(cluster.router_address, request(tokens=prompt, max_tokens=4, ignore_eos=True))
    time.sleep(6)  # six pings on every idle connection
    again = stream(cluster.router_address, request(tokens=prompt, max_tokens=4, ignore_eos=True))
    assert tokens_of(again) == tokens_of(first)
    for child in (cluster.router, cluster.nodes["node-0"], cluster.block_service):
        log = child.log_path.read_text(errors="replace")
        assert "too_many_pings" not in log and "GOAWAY" not in log, f"{child.name}:\n{child.log_tail()}"
