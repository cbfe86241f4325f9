"""``kvfleet generate``: send one prompt to the router and print the tokens as they stream in.

Also ``demo_requests``: the demo's concurrent traffic from two tenants, some sharing a long prefix.
"""

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
    parser.add_argument("--router", default=os.environ.get("KVFLEET_ROUTER", DEFAULT_ROUTER),
                        help=f"router host:port (default $KVFLEET_ROUTER or {DEFAULT_ROUTER})")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="tenant API key (default $KVFLEET_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--request-id", default="")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole call")


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


def run(args: argparse.Namespace) -> int:
    import grpc

    if args.system is not None and not args.chat:
        print("--system goes with --chat", file=sys.stderr)
        return 2
    from kvfleet import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    with rpc.sync_channel(args.router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for chunk in stub.Generate(request_message(args), metadata=metadata, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    u = chunk.usage
                    reason = inference_pb2.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_")
                    print(f"\n[{reason.lower()}: node {chunk.node_id}, {u.prompt_tokens} prompt tokens "
                          f"({u.cached_tokens} cached), {u.completion_tokens} generated]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


# -- the cluster demo's traffic (kvfleet_cli.demo runs it against a LocalCluster) --------------------

DEMO_PREFIX = (
    "You are a careful assistant for a fleet of language model servers. Answer briefly, cite the "
    "block table when asked about memory, and never invent a tenant's quota. The question follows. "
)
DEMO_REQUESTS = [  # (tag, api key of kvfleet_cli.local_cluster.DEMO_TENANTS, prompt)
    ("gold-1", "sk-gold", DEMO_PREFIX + "What is a block?"),
    ("free-1", "sk-free", DEMO_PREFIX + "What is a slot?"),
    ("gold-2", "sk-gold", DEMO_PREFIX + "Who owns the page table?"),
    ("gold-3", "sk-gold", "Short question without the shared prefix."),
    ("free-2", "sk-free", DEMO_PREFIX + "What happens when a node dies?"),
    ("free-3", "sk-free", "Another short one."),
]


async def demo_requests(router: str, max_tokens: int = 24, out=sys.stdout, stream: bool = False) -> list[dict]:
    """Send ``DEMO_REQUESTS`` concurrently (the first of each tenant first, so that the others find
    its prefix cached), print each request's text, node and cached tokens as it finishes (and each
    chunk as it arrives when ``stream``), and return those figures in finishing order."""
    import asyncio

    from kvfleet import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    finished: list[dict] = []
    async with rpc.channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(tag: str, key: str, prompt: str, first_token: asyncio.Event | None = None) -> None:
            req = inference_pb2.GenerateRequest(
                request_id=tag, text=prompt,
                sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            text: list[str] = []
            async for chunk in stub.Generate(req, metadata=[("authorization", f"Bearer {key}")]):
                text.append(chunk.text)
                if stream and chunk.token_ids:
                    print(f"[{tag:<6}] +{len(chunk.token_ids)} token(s) {chunk.text!r}", file=out, flush=True)
                if first_token is not None:
                    first_token.set()
                last = chunk
            u = last.usage
            finished.append(dict(tag=tag, node=last.node_id, prompt_tokens=u.prompt_tokens,
                                 cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens))
            print(f"[{tag:<6}] node {last.node_id}, {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
                  f"{u.completion_tokens} generated: {''.join(text)!r}", file=out, flush=True)

        firsts = {"sk-gold": asyncio.Event(), "sk-free": asyncio.Event()}
        leaders = [asyncio.create_task(one(*DEMO_REQUESTS[i], firsts[DEMO_REQUESTS[i][1]])) for i in (0, 1)]
        await asyncio.gather(*(e.wait() for e in firsts.values()))  # their prompts are in the cache
        await asyncio.gather(*leaders, *(one(*r) for r in DEMO_REQUESTS[2:]))
    return finished
