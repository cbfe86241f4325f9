"""``kvfleet plan``: how much KV a model needs per token, how many sequences of a context fit a
device, which block size each scenario wants, and how many devices a throughput target takes.
Arguments in, one plan out (a table, or ``--json``); the arithmetic is ``kvfleet.cli.planning``."""

from __future__ import annotations

import argparse
import json
import sys

from kvfleet.cli.planning.capacity import KV_DTYPES, CapacityRequest
from kvfleet.cli.planning.devices import CPU, KNOWN, Device, device_named
from kvfleet.cli.planning.model_dir import shape_from_dir
from kvfleet.cli.planning.plan import make_plan
from kvfleet.cli.planning.render import plan_dict, plan_text
from kvfleet.cli.planning.shapes import PRESETS, ModelShape
from kvfleet.cli.planning.sizing import SizingRequest

BLOCK_PRESETS = {"chat": 256, "code": 512, "document": 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a Hugging Face model directory (its config.json)")
    model.add_argument("--preset", help=f"a built-in model: {', '.join(PRESETS)}")
    parser.add_argument("--device", default="h100-80g", help=f"one of {', '.join(KNOWN)} (default h100-80g)")
    parser.add_argument("--device-memory", type=int, help="bytes of device memory (overrides the device's)")
    parser.add_argument("--memory-bandwidth", type=float, help="GB/s (overrides the device's; cpu: skips the measurement)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="devices per replica (default 1)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES, help="default: the model's dtype")
    parser.add_argument("--context", type=int, help="tokens per sequence (default: the model's positions)")
    parser.add_argument("--block-size", default="256", help="tokens per block, or chat / code / document (default 256)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of device memory to use (0.9)")
    parser.add_argument("--kv-cache-memory", type=int,
                        help="bytes of KV pool per device, as `kvfleet compute --kv-cache-memory` takes it")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (activation reserve)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (activation reserve)")
    parser.add_argument("--target-tokens-per-s", type=float, help="generated tokens/s to size hardware for")
    parser.add_argument("--avg-context", type=int, help="average tokens per sequence for sizing (default --context)")
    parser.add_argument("--concurrency", type=int, default=64, help="sequences in flight for sizing (default 64)")
    parser.add_argument("--avg-output", type=int, default=256, help="generated tokens per request for sizing (256)")
    parser.add_argument("--force", action="store_true", help="plan a context longer than the model's positions")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load_model(args: argparse.Namespace) -> ModelShape:
    if args.model:
        return shape_from_dir(args.model)
    key = args.preset.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def load_device(args: argparse.Namespace) -> Device:
    bandwidth = args.memory_bandwidth * 1e9 if args.memory_bandwidth else None
    if bandwidth is not None and bandwidth <= 0:
        raise ValueError(f"--memory-bandwidth must be positive GB/s, got {args.memory_bandwidth}")
    if args.device_memory is not None and args.device_memory <= 0:
        raise ValueError(f"--device-memory must be positive bytes, got {args.device_memory}")
    if args.device == CPU:
        from kvfleet.cli.planning.cpu_device import measured_cpu

        return measured_cpu(args.device_memory, bandwidth)
    device = device_named(args.device)
    if args.device_memory:
        device = device.with_memory(args.device_memory)
    if bandwidth:
        device = Device(device.name, device.memory_bytes, bandwidth, device.flops, device.runtime_overhead)
    return device


def block_size(value: str) -> int:
    if value in BLOCK_PRESETS:
        return BLOCK_PRESETS[value]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--block-size must be an integer or one of {', '.join(BLOCK_PRESETS)}, got {value!r}") from None


def build(args: argparse.Namespace):
    model = load_model(args)
    device = load_device(args)
    context = args.context if args.context is not None else model.max_position_embeddings
    request = CapacityRequest(
        context=context, block_size=block_size(args.block_size), kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel=args.tensor_parallel, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs)
    sizing = None
    if args.target_tokens_per_s is not None:
        sizing = SizingRequest(args.target_tokens_per_s, args.avg_context or context, args.concurrency, args.avg_output)
    return make_plan(model, device, request, sizing, force=args.force)


def run(args: argparse.Namespace) -> int:
    try:
        plan = build(args)
    except (ValueError, OSError) as exc:
        print(f"kvfleet plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(plan), indent=2) if args.json else plan_text(plan))
    return 0
