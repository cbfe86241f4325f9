"""The demo's traffic: two tenants asking the real model (SmolLM2-135M-Instruct) questions, most of
them under one long shared system prompt, so the second and later requests find it in the prefix
cache. Each question goes as chat messages (the public API's chat form): the router renders them with
the model's own chat template, and the answer ends at the model's end of turn. Each request's answer
is printed a line at a time as it streams, then its node and cached tokens."""

from __future__ import annotations

import sys
from dataclasses import dataclass

SYSTEM = (
    "You are the help desk of a small library in a quiet town. The library opens at nine in the "
    "morning and closes at six in the evening, every day except Sunday. Members may borrow up to "
    "five books for three weeks. Answer visitors' questions politely, in one or two short sentences, "
    "in plain English."
)


@dataclass(slots=True, frozen=True)
class Question:
    text: str
    system: str | None = SYSTEM  # the shared system prompt, or none

    def messages(self) -> list[tuple[str, str]]:
        """(role, content) of the conversation: the system message if any, then the question."""
        return ([("system", self.system)] if self.system else []) + [("user", self.text)]


DEMO_REQUESTS = [  # (tag, api key of kvfleet.cli.local_cluster.DEMO_TENANTS, question)
    ("gold-1", "sk-gold", Question("When does the library open?")),
    ("free-1", "sk-free", Question("How many books can I borrow?")),
    ("gold-2", "sk-gold", Question("Is the library open on Sunday?")),
    ("gold-3", "sk-gold", Question("What is the capital of France?", system=None)),
    ("free-2", "sk-free", Question("How long may I keep a book?")),
    ("free-3", "sk-free", Question("Name three primary colors.", system=None)),
]
IN_PROCESS_QUESTIONS = [Question("When does the library open?"), Question("Can I borrow ten books?"),
                        Question("What is the capital of France?", system=None),
                        Question("Give me a synonym for happy.", system=None)]


class LinePrinter:
    """A streamed answer shown a line at a time (tokens of six answers interleaved are unreadable)."""

    def __init__(self, tag: str, out=sys.stdout):
        self.tag, self.out, self.pending = tag, out, ""

    def push(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                print(f"[{self.tag:<6}] {line}", file=self.out, flush=True)

    def flush(self) -> None:
        if self.pending.strip():
            print(f"[{self.tag:<6}] {self.pending}", file=self.out, flush=True)
        self.pending = ""


async def demo_requests(router: str, max_tokens: int = 48, out=sys.stdout) -> tuple[list[dict], dict[str, str]]:
    """Send ``DEMO_REQUESTS`` concurrently (the first of each tenant first, so that the others find
    the shared system prompt cached); each answered one's figures in finishing order, and the
    error of each that failed (its tag → ``CODE: details``)."""
    import asyncio

    import grpc

    from kvfleet.core import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    finished: list[dict] = []
    errors: dict[str, str] = {}
    async with rpc.channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(tag: str, key: str, question: Question, first_token: asyncio.Event | None = None) -> None:
            chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role=role, content=content)
                                                        for role, content in question.messages()])
            req = inference_pb2.GenerateRequest(
                request_id=tag, chat=chat, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens))
            printer = LinePrinter(tag, out)
            try:
                async for chunk in stub.Generate(req, metadata=[("authorization", f"Bearer {key}")]):
                    printer.push(chunk.text)
                    if first_token is not None:
                        first_token.set()
                    last = chunk
            except grpc.RpcError as e:
                printer.flush()
                errors[tag] = f"{e.code().name}: {e.details()}"
                print(f"[{tag:<6}] -- failed: {errors[tag]}", file=out, flush=True)
                return
            finally:
                if first_token is not None:  # answered or failed: the others need not wait for it
                    first_token.set()
            printer.flush()
            u = last.usage
            finished.append(dict(tag=tag, node=last.node_id, prompt_tokens=u.prompt_tokens,
                                 cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens))
            print(f"[{tag:<6}] -- node {last.node_id}, {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
                  f"{u.completion_tokens} generated", file=out, flush=True)

        firsts = {"sk-gold": asyncio.Event(), "sk-free": asyncio.Event()}
        leaders = [asyncio.create_task(one(*DEMO_REQUESTS[i], firsts[DEMO_REQUESTS[i][1]])) for i in (0, 1)]
        await asyncio.gather(*(e.wait() for e in firsts.values()))  # their prompts are in the cache
        await asyncio.gather(*leaders, *(one(*r) for r in DEMO_REQUESTS[2:]))
    return finished, errors
