"""``kvfleet demo``: prompts through the in-process engine on the demo model, tokens streamed as
they are generated, then a stats line."""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "The fleet shares one page table. ",
    "The fleet shares one page table. Tenants",
    "Paged attention reads each block in place",
    "Once upon a time",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (see `kvfleet make-model`)")
    parser.add_argument("--block-size", default="16", help="tokens per KV block, or chat/code/document")
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="KV pool bytes")
    parser.add_argument("--max-tokens", type=int, default=24)


def run(args: argparse.Namespace) -> int:
    from compute_service.engine import EngineConfig, LLMEngine
    from compute_service.sampling import SamplingParams

    engine = LLMEngine(args.model, EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory))
    names = {f"p{i}": prompt for i, prompt in enumerate(DEMO_PROMPTS)}

    def show(out) -> None:
        if out.new_text:
            sys.stdout.write(f"[{out.request_id}] {out.new_text!r}\n")
        if out.finished:
            sys.stdout.write(f"[{out.request_id}] done: {out.finish_reason}, {out.completion_tokens} tokens, "
                             f"{out.cached_tokens} prompt tokens from the prefix cache\n")
        sys.stdout.flush()

    for rid, prompt in names.items():
        print(f"[{rid}] prompt: {prompt!r}")
    started = time.perf_counter()
    # the first prompt runs alone so that the second finds its prefix cached
    for batch in (["p0"], ["p1", "p2", "p3"]):
        for rid in batch:
            engine.add_request(rid, names[rid], SamplingParams(max_tokens=args.max_tokens, temperature=0.8,
                                                               top_p=0.95, seed=7), on_output=show)
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.perf_counter() - started
    s = engine.stats()
    b = s.blocks
    print(f"stats: {s.generated_tokens} tokens in {elapsed:.2f}s ({s.generated_tokens / elapsed:.1f} tokens/s), "
          f"KV blocks used {b.num_used} / cached {b.num_cached} / free {b.num_free} of {b.num_blocks}, "
          f"prefix-cache hits {b.prefix_hits}/{b.prefix_queries} blocks, preemptions {s.num_preemptions}")
    return 0
