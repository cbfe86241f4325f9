"""The demo's traffic: two tenants asking the real model (SmolLM2-135M-Instruct) questions, most of
them under one long shared system prompt, so the second and later requests find it in the prefix
cache. Prompts are ChatML rendered here by hand (the model's template, without its default system
line); answers end at the model's end of turn. Each request's answer is printed a line at a time as
it streams, then its node and cached tokens."""

from __future__ import annotations

import sys

SYSTEM = (
    "You are the help desk of a small library in a quiet town. The library opens at nine in the "
    "morning and closes at six in the evening, every day except Sunday. Members may borrow up to "
    "five books for three weeks. Answer visitors' questions politely, in one or two short sentences, "
    "in plain English."
)


def chatml(question: str, system: str | None = SYSTEM) -> str:
    """SmolLM2's chat template, applied to one user turn, the assistant's turn opened."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


DEMO_REQUESTS = [  # (tag, api key of kvfleet_cli.local_cluster.DEMO_TENANTS, prompt)
    ("gold-1", "sk-gold", chatml("When does the library open?")),
    ("free-1", "sk-free", chatml("How many books can I borrow?")),
    ("gold-2", "sk-gold", chatml("Is the library open on Sunday?")),
    ("gold-3", "sk-gold", chatml("What is the capital of France?", system=None)),
    ("free-2", "sk-free", chatml("How long may I keep a book?")),
    ("free-3", "sk-free", chatml("Name three primary colors.", system=None)),
]
IN_PROCESS_PROMPTS = [chatml(q) for q in ("When does the library open?", "Can I borrow ten books?")] + [
    chatml("What is the capital of France?", system=None), chatml("Give me a synonym for happy.", system=None)]


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


async def demo_requests(router: str, max_tokens: int = 48, out=sys.stdout) -> list[dict]:
    """Send ``DEMO_REQUESTS`` concurrently (the first of each tenant first, so that the others find
    the shared system prompt cached) and return each one's figures in finishing order."""
    import asyncio

    from kvfleet import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    finished: list[dict] = []
    async with rpc.channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(tag: str, key: str, prompt: str, first_token: asyncio.Event | None = None) -> None:
            req = inference_pb2.GenerateRequest(
                request_id=tag, text=prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens))
            printer = LinePrinter(tag, out)
            async for chunk in stub.Generate(req, metadata=[("authorization", f"Bearer {key}")]):
                printer.push(chunk.text)
                if first_token is not None:
                    first_token.set()
                last = chunk
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
    return finished
