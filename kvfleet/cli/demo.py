"""``kvfleet demo``: the local cluster on the real model (SmolLM2-135M-Instruct, ``kvfleet models
pull smollm2``) serving two tenants, or (``--in-process``) the engine alone. Either way the answers
are printed as they stream, then a summary."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvfleet.cli.demo_traffic import IN_PROCESS_QUESTIONS
from kvfleet.cli.models_pull import default_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(default_model_dir()),
                        help=f"model directory (default {default_model_dir()}: `kvfleet models pull smollm2`)")
    parser.add_argument("--nodes", type=int, default=2, help="compute nodes of the local cluster")
    parser.add_argument("--block-size", default="16", help="tokens per KV block, or chat/code/document")
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="KV pool bytes per node")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--in-process", action="store_true", help="run the engine in this process, no cluster")


def run(args: argparse.Namespace) -> int:
    if not (Path(args.model) / "config.json").is_file():
        hint = " (run `kvfleet models pull smollm2`)" if Path(args.model) == default_model_dir() else ""
        print(f"kvfleet demo: {args.model} is not a model directory (no config.json){hint}", file=sys.stderr)
        return 2
    from kvfleet.compute_service.model.config import ModelLoadError

    try:
        return run_in_process(args) if args.in_process else run_cluster(args)
    except ModelLoadError as e:  # a directory with a config.json but no usable weights or tokenizer
        print(f"kvfleet demo: {e}", file=sys.stderr)
        return 2


def run_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from kvfleet.cli.demo_traffic import demo_requests
    from kvfleet.cli.local_cluster import LocalCluster

    print(f"starting a local cluster: etcd, block_service, {args.nodes} compute nodes, router ...", flush=True)
    started = time.perf_counter()
    with LocalCluster(args.model, args.nodes, block_size=int(args.block_size),
                      kv_cache_memory=args.kv_cache_memory) as cluster:
        print(f"cluster up in {time.perf_counter() - started:.1f}s; router at {cluster.router_address}; "
              f"logs in {cluster.work_dir}", flush=True)
        print("tenants: gold (paid level 2) and free (paid level 0); most questions share a long system prompt\n")
        started = time.perf_counter()
        finished, errors = asyncio.run(demo_requests(cluster.router_address, args.max_tokens))
        elapsed = time.perf_counter() - started
        tokens = sum(r["completion_tokens"] for r in finished)
        cached = sum(r["cached_tokens"] for r in finished)
        prompt = sum(r["prompt_tokens"] for r in finished)
        print(f"\n{len(finished)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s); "
              f"{cached} of {prompt} prompt tokens came from the prefix cache")
        print("\ncluster summary (block_service):")
        print(cluster.summary())
        print("\nstopping the cluster ...", flush=True)
    print("stopped; no process left behind")
    return failed_line(errors, len(finished) + len(errors))


def run_in_process(args: argparse.Namespace) -> int:
    from kvfleet.cli.demo_traffic import LinePrinter
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams
    from kvfleet.router.chat_template import ChatMessage, ChatTemplate

    engine = LLMEngine(args.model, EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory))
    template = ChatTemplate.from_model_dir(args.model)  # as the router renders a chat request
    questions = {f"p{i}": question for i, question in enumerate(IN_PROCESS_QUESTIONS)}
    names = {rid: template.render([ChatMessage(role, content) for role, content in q.messages()])
             for rid, q in questions.items()}

    printers = {rid: LinePrinter(rid) for rid in names}
    errors: dict[str, str] = {}

    def show(out) -> None:
        printers[out.request_id].push(out.new_text)
        if out.finished:
            printers[out.request_id].flush()
            if out.error is not None:
                errors[out.request_id] = out.error
                sys.stdout.write(f"[{out.request_id:<6}] -- failed: {out.error}\n")
            else:
                sys.stdout.write(f"[{out.request_id:<6}] -- {out.finish_reason}, {out.completion_tokens} tokens, "
                                 f"{out.cached_tokens} prompt tokens from the prefix cache\n")
        sys.stdout.flush()

    for rid, question in questions.items():
        shared = " (under the shared system prompt)" if question.system else ""
        print(f"[{rid:<6}] asks: {question.text}{shared}")
    started = time.perf_counter()
    # the first prompt runs alone so that the second finds its prefix cached
    for batch in (["p0"], ["p1", "p2", "p3"]):
        for rid in batch:
            engine.add_request(rid, names[rid], SamplingParams(max_tokens=args.max_tokens, temperature=0.3,
                                                               top_p=0.9, seed=7), on_output=show)
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.perf_counter() - started
    s = engine.stats()
    b = s.blocks
    print(f"stats: {s.generated_tokens} tokens in {elapsed:.2f}s ({s.generated_tokens / elapsed:.1f} tokens/s), "
          f"KV blocks used {b.num_used} / cached {b.num_cached} / free {b.num_free} of {b.num_blocks}, "
          f"prefix-cache hits {b.prefix_hits}/{b.prefix_queries} blocks, preemptions {s.num_preemptions}")
    return failed_line(errors, len(questions))


def failed_line(errors: dict[str, str], asked: int) -> int:
    """0 when every request was answered; else one line on stderr (the first error) and 1."""
    if not errors:
        return 0
    print(f"kvfleet demo: {len(errors)} of {asked} requests failed: {next(iter(errors.values()))}", file=sys.stderr)
    return 1
