"""``kvfleet compute``: one compute node's command line, its checks before the model loads, and its
run (the life itself, start to drained exit, is ``compute_service.node.lifecycle``).

A node outlives its peers' trouble: started while block_service is down, it waits for it; when
block_service goes away later, requests that need it wait (or move to another node) and the node
resyncs its pool when it is back; when etcd loses the node's lease, the registration takes a new
one and the pool is synced again. Only its own engine thread dying ends it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from compute_service.kv.tier_flags import add_tier_arguments, check_tier_flags
from compute_service.node import warm_start
from compute_service.node.lifecycle import serve
from kvfleet.metrics_server import add_metrics_argument

log = logging.getLogger(__name__)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _nonnegative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve Compute on (port 0: any)")
    parser.add_argument("--advertise", default=None,
                        help="host:port the router should dial (default: --listen with the bound port)")
    parser.add_argument("--model", required=True, help="Hugging Face-format model directory")
    parser.add_argument("--block-service", default=None,
                        help="block_service host:port, or 'etcd': the leader elected in --etcd (with --etcd a "
                             "fixed address is left for the leader too once one is elected); default: an "
                             "in-process page table, for one node alone")
    parser.add_argument("--etcd", default=None, help="etcd URL to register in, e.g. http://127.0.0.1:2379")
    parser.add_argument("--node-id", required=True, help="this node's id in etcd and block_service")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool (default: a share of free memory)")
    parser.add_argument("--block-size", default="256", help="tokens per block (16-2048, multiple of 16) or chat/code/document")
    parser.add_argument("--dtype", default="auto", help="auto (default): bfloat16 on a CPU with native bfloat16 "
                        "(AMX, AVX512-BF16), else float32; or float32 (token-exact against transformers), "
                        "bfloat16, float16")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV pool dtype: auto (= --dtype), float32, bfloat16, float16 or fp8_e4m3 "
                             "(float8_e4m3fn with a float32 scale per token and KV head: about half of bfloat16)")
    parser.add_argument("--kv-layout", default="paged", help="paged (default) or contiguous: each sequence reserves "
                        "--max-model-len slots at admission, no prefix sharing (the traditional baseline)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="longest sequence, prompt and output (default and most: the model's context length)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=64,
                        help="most sequences running at once (the live cap of --p99-itl-target-ms stays below it)")
    parser.add_argument("--long-prefill-token-threshold", type=_nonnegative_int, default=0, metavar="N",
                        help="a prompt with more than N tokens left to prefill is long: short prompts go first, and "
                             "a long one's chunk is what they leave of N tokens a step (at least a block), so a short "
                             "prompt is not held for a long one's prefill (default 0: off, a step's whole budget)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                        help="most tokens one step computes: decode tokens and prompt chunks (default 2048; with "
                             "--p99-itl-target-ms, a few per sequence keeps a burst of prompts out of one step)")
    parser.add_argument("--p99-itl-target-ms", type=_positive_float, default=None, metavar="MS",
                        help="hold the p99 inter-token latency near MS: every --control-interval-s the live cap "
                             "on running sequences moves x0.9 when over, x1.1 (up to --max-num-seqs) when well "
                             "under, and each step's token budget with it in proportion; requests above it wait, "
                             "and the router sees the reduced capacity (default: off)")
    parser.add_argument("--control-interval-s", type=_positive_float, default=2.0, metavar="S",
                        help="seconds between the P99 controller's decisions (default 2; its window is 10 of them)")
    parser.add_argument("--lease-ttl", type=int, default=5, help="etcd lease seconds")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to let requests finish on SIGTERM")
    parser.add_argument("--stream-interval", type=_positive_int, default=1,
                        help="tokens per streamed chunk (default 1: every token as soon as it exists)")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                        help="an idle node holds its first step while requests keep arriving less than this "
                             "many ms apart (at most 10 times it), so a burst is scheduled as one batch (default "
                             "5: a burst's requests reach a busy router's node up to ~5 ms apart); 0: off")
    parser.add_argument("--reconcile-interval", type=_positive_float, default=30.0,
                        help="seconds between reconciliations of this node's blocks with block_service "
                             "(block_service releases what the node no longer holds; default 30)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once READY")
    add_tier_arguments(parser)
    add_metrics_argument(parser)
    warm_start.add_arguments(parser)
    parser.add_argument("--dependency-timeout", type=_positive_float, default=60.0,
                        help="seconds to wait at start for etcd and block_service to answer before giving up "
                             "(default 60; once started, the node waits for them as long as it takes)")


def preflight(args: argparse.Namespace) -> None:
    """What a person can get wrong, answered before the model loads: the KV cache dtype (a known
    name, FP8 where this torch and device hold it), the port, the model directory, the peers'
    addresses (waited for a while: they may be starting too)."""
    import torch

    from compute_service.engine.cpu_host import host_cpu_flags, resolve_dtype
    from compute_service.kv.layout import parse_kv_layout
    from compute_service.kv.pool import kv_cache_dtype
    from compute_service.model.config import ModelConfig
    from kvfleet.leader import FROM_ETCD
    from kvfleet.metrics_server import metrics_listen
    from kvfleet.preflight import PreflightError, check_port_free, wait_reachable

    try:
        args.dtype = resolve_dtype(args.dtype, torch.device(args.device).type, host_cpu_flags())
        kv_cache_dtype(args.kv_cache_dtype, args.dtype, torch.device(args.device))
        parse_kv_layout(args.kv_layout)
        check_tier_flags(args.kv_host_memory, args.kv_disk_dir, args.kv_disk_bytes, args.preemption_mode)
    except (ValueError, RuntimeError) as e:  # RuntimeError: a device torch cannot use
        raise PreflightError(str(e)) from None
    check_port_free(args.listen)
    if args.metrics_port is not None:
        check_port_free(metrics_listen(args.listen, args.metrics_port), "metrics")
    ModelConfig.from_dir(args.model)
    warm_start.preflight(args)
    if args.etcd:
        wait_reachable("etcd", args.etcd, args.dependency_timeout, log.warning)
    if args.block_service == FROM_ETCD and not args.etcd:
        raise PreflightError("--block-service etcd needs --etcd: the block_service leader is elected there")
    if args.block_service and args.block_service != FROM_ETCD:
        wait_reachable("block_service", args.block_service, args.dependency_timeout, log.warning)


def run(args: argparse.Namespace) -> int:
    from compute_service.model.config import ModelLoadError
    from compute_service.node import mem_probe
    from kvfleet import event_loop
    from kvfleet.preflight import PreflightError
    from kvfleet.tracing import setup_tracing, shutdown_tracing

    mem_probe.start_if_asked(args.node_id)  # a diagnostic, off unless KVFLEET_MEM_PROBE is set
    try:
        preflight(args)
    except (PreflightError, ModelLoadError) as e:
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    setup_tracing("kvfleet-compute")
    try:
        event_loop.run(serve(args))
    except (ModelLoadError, PreflightError) as e:  # found while loading the weights or sizing the pool
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
    return 0
