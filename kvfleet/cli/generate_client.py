"""``kvfleet generate``: send one prompt to the router and print the tokens as they stream in."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_ROUTER = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a chat message, rendered by the model's chat template "
                             "(the answer ends with the assistant's turn)")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    parser.add_argument("--router", default=os.environ.get("KVFLEET_ROUTER"),
                        help="router host:port (default $KVFLEET_ROUTER, else the cluster `kvfleet up` runs on "
                             f"this machine, else {DEFAULT_ROUTER})")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="tenant API key (default $KVFLEET_API_KEY, else the demo key of `kvfleet up`'s cluster)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--request-id", default="")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole call")
    parser.add_argument("--tls-ca", default=os.environ.get("KVFLEET_TLS_CA"), metavar="FILE",
                        help="the router serves TLS (its --tls-cert): trust this CA certificate (PEM; default "
                             "$KVFLEET_TLS_CA, else plaintext)")


def public_ca(command: str, path: str | None) -> bytes | None:
    """The CA certificate a client of the router's TLS door trusts (``--tls-ca``); ValueError, one line."""
    if not path:
        return None
    try:
        ca = open(path, "rb").read()
    except OSError as err:
        raise ValueError(f"kvfleet {command}: --tls-ca {path}: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise ValueError(f"kvfleet {command}: --tls-ca {path}: not a PEM certificate")
    return ca


def request_message(args: argparse.Namespace):
    from kvfleet.v1 import inference_pb2

    req = inference_pb2.GenerateRequest(
        request_id=args.request_id,
        sampling=inference_pb2.SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        ),
    )
    if not args.chat:
        req.text = args.prompt
        return req
    if args.system is not None:
        req.chat.messages.add(role="system", content=args.system)
    req.chat.messages.add(role="user", content=args.prompt)
    return req


def bearer(api_key: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries a tenant's API key (none without a key: the router answers
    UNAUTHENTICATED)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def finish_name(finish_reason: int) -> str:
    """``FINISH_REASON_LENGTH`` → ``length``."""
    from kvfleet.v1 import inference_pb2

    return inference_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()


def no_router_line(command: str, router: str) -> str:
    return (f"kvfleet {command}: no router answers at {router} (start a local cluster with `kvfleet up`, "
            "or pass --router)")


def find_router(args: argparse.Namespace) -> None:
    """Fill in ``--router`` and ``--api-key`` from the local cluster's state file when not given."""
    from kvfleet.cli.cluster_state import ClusterState

    if args.router and args.api_key:
        return
    state = ClusterState.read()
    if args.router is None:
        args.router = state.router if state else DEFAULT_ROUTER
    if args.api_key is None and state is not None and state.router == args.router:
        args.api_key = state.api_key


def run(args: argparse.Namespace) -> int:
    import grpc

    if args.system is not None and not args.chat:
        print("--system goes with --chat", file=sys.stderr)
        return 2
    from kvfleet.core import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    find_router(args)
    metadata = bearer(args.api_key)
    try:
        ca = public_ca("generate", args.tls_ca)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    with rpc.sync_channel(args.router, public_ca=ca) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=min(5.0, args.timeout))
        except grpc.FutureTimeoutError:
            print(no_router_line("generate", args.router), file=sys.stderr)
            return 1
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for chunk in stub.Generate(request_message(args), metadata=metadata, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    u = chunk.usage
                    print(f"\n[{finish_name(chunk.finish_reason)}: node {chunk.node_id}, {u.prompt_tokens} prompt tokens "
                          f"({u.cached_tokens} cached), {u.completion_tokens} generated]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
