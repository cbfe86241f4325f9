"""One 131,072-token prompt through the whole cluster with FP8 KV, then decoding at 128K context.

A local cluster (etcd, block_service, one ``kvfleet compute`` node, the router) serves the long
preset (``kvfleet make-model --preset long``: 131,072 positions, 2 layers, one KV head of 64) with
``--kv-cache-dtype fp8_e4m3`` and a KV pool sized by ``kvfleet plan``'s arithmetic for exactly one
sequence of the prompt plus its output (blocks of 1024, the plan's "document" scenario). One
client sends the prompt as token ids through the router's public ``Generate`` (the message alone
is ~260 KB), greedy, and reads the stream:

    prefill_s            request sent → first token (the node prefills in chunks of
                         max_num_batched_tokens, 2048, each reported to the router as progress)
    decode_tokens_per_s  (tokens - 1) / (last token - first token), at 128K context
    kv_bytes_used        the node's blocks in use (block_service's count, polled while the request
                         runs, at its peak) x bytes per block
    kv_bytes_planned     the plan's blocks per sequence x block bytes for the same context and dtype

    python bench/long_context.py [--quick] [--json] [--tokens N] [--decode N]

The full prompt is 131,072 - 16 = 131,056 tokens, so prompt and output fill the model's 131,072
positions exactly (a 131,072-token prompt leaves no position for an output token: the node refuses
it INVALID_ARGUMENT, as ``tests/cluster/test_cluster_long_context.py`` checks). ``--quick``: 16,384
tokens. The full run takes tens of minutes on a 2-core CPU: attention over the prompt is quadratic
(64x the work of the quick run's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model, seeded_prompts  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402

LONG_MODEL = ROOT / "models" / "bench-long"
FULL_TOKENS, QUICK_TOKENS = 131072, 16384
DECODE = 16
BLOCK_SIZE = 1024
KV_DTYPE = "fp8_e4m3"
API_KEY = "sk-gold"
POLL_S = 0.5


def planned_pool(model_dir: Path, context: int) -> tuple[int, int]:
    """(bytes of KV the plan gives one sequence of ``context`` tokens, bytes per token): whole
    blocks, as the engine allocates them."""
    from kvfleet.cli.planning.capacity import CapacityRequest, capacity
    from kvfleet.cli.planning.devices import device_named
    from kvfleet.cli.planning.model_dir import shape_from_dir

    # the device only matters without --kv-cache-memory; the budget here is one block table's worth
    request = CapacityRequest(context=context, block_size=BLOCK_SIZE, kv_cache_dtype=KV_DTYPE, kv_cache_memory=1 << 40)
    cap = capacity(shape_from_dir(model_dir), device_named("h200"), request)
    return cap.blocks_per_seq * cap.block_bytes, cap.kv_bytes_per_token


class BlockWatch:
    """Polls block_service for the node's blocks in use while the request runs; keeps the peak."""

    def __init__(self, address: str):
        self.address = address
        self.peak_used = self.bytes_per_block = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._poll()), daemon=True)

    async def _poll(self) -> None:
        from kvfleet.block_service.client import BlockManagerClient

        async with BlockManagerClient(self.address, timeout_s=10) as client:
            while not self._stop.is_set():
                nodes, _ = await client.stats()
                for n in nodes:
                    self.peak_used = max(self.peak_used, n.num_used)
                    self.bytes_per_block = n.bytes_per_block
                await asyncio.sleep(POLL_S)

    def __enter__(self) -> BlockWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def generate(router: str, prompt: list[int], decode: int, timeout_s: float) -> tuple[float, list[float], list[int]]:
    """(seconds to the first token, arrival time of each token, the tokens) of one greedy request."""
    from kvfleet.core import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    req = inference_pb2.GenerateRequest(
        tokens=inference_pb2.TokenIds(ids=prompt),
        sampling=inference_pb2.SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True))
    arrivals: list[float] = []
    tokens: list[int] = []
    with rpc.sync_channel(router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started = time.perf_counter()
        for chunk in stub.Generate(req, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=timeout_s):
            now = time.perf_counter()
            arrivals += [now] * len(chunk.token_ids)
            tokens += chunk.token_ids
    return arrivals[0] - started, arrivals, tokens


def run(num_tokens: int, decode: int, timeout_s: float) -> dict:
    from kvfleet.cli.local_cluster import LocalCluster

    model = ensure_model("long", LONG_MODEL)
    planned, per_token = planned_pool(model, num_tokens + decode)
    prompt = seeded_prompts(1, num_tokens, num_tokens, seed=128)[0]
    with LocalCluster(model, num_nodes=1, block_size=BLOCK_SIZE, kv_cache_memory=planned, kv_cache_dtype=KV_DTYPE,
                      http=False, metrics=False, router_args=("--stall-timeout-s", "120")) as cluster:
        with BlockWatch(cluster.block_service_address) as watch:
            prefill_s, arrivals, tokens = generate(cluster.router_address, prompt, decode, timeout_s)
            time.sleep(2 * POLL_S)
    decode_s = arrivals[-1] - arrivals[0]
    return {
        "prompt_tokens": num_tokens, "decoded_tokens": len(tokens), "kv_cache_dtype": KV_DTYPE,
        "block_size": BLOCK_SIZE, "prefill_s": round(prefill_s, 2),
        "prefill_tokens_per_s": round(num_tokens / prefill_s, 1),
        "decode_tokens_per_s": round((len(tokens) - 1) / decode_s, 2) if decode_s > 0 else None,
        "kv_bytes_used": watch.peak_used * watch.bytes_per_block, "kv_bytes_planned": planned,
        "kv_bytes_per_token_planned": per_token, "tokens": tokens, "cpu": cpu_model(), "dtype": engine_dtype(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS:,} prompt tokens (under 2 minutes)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"prompt tokens (default {FULL_TOKENS:,} minus --decode: the whole window)")
    parser.add_argument("--decode", type=int, default=DECODE, help=f"tokens to generate (default {DECODE})")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the request")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # three blocks: the node's warm-up needs that many in its pool
        args.tokens, args.decode = args.tokens or 3 * BLOCK_SIZE - 4, 4
    # the full run fills the model's window: prompt + output = 131,072 positions (a prompt of all
    # 131,072 would leave no position for a token, and the node refuses it INVALID_ARGUMENT)
    num_tokens = args.tokens or (QUICK_TOKENS if args.quick else FULL_TOKENS - args.decode)
    if num_tokens < 1 or args.decode < 2:
        parser.error("--tokens must be at least 1 and --decode at least 2")
    if num_tokens + args.decode > FULL_TOKENS:
        parser.error(f"--tokens + --decode must fit the long preset's {FULL_TOKENS:,} positions")
    result = run(num_tokens, args.decode, args.timeout)
    print(report(result))
    if args.json:
        print(json.dumps(result))
    return 0


def report(r: dict) -> str:
    used, planned = r["kv_bytes_used"], r["kv_bytes_planned"]
    return "\n".join([
        f"long preset, {r['prompt_tokens']:,}-token prompt through router -> node -> block_service, "
        f"KV {r['kv_cache_dtype']} in blocks of {r['block_size']}, {r['cpu']} (shared machine)",
        f"prefill (chunked, to the first token): {r['prefill_s']:.1f} s ({r['prefill_tokens_per_s']:,.0f} tokens/s)",
        f"decode at {r['prompt_tokens']:,} context: {r['decode_tokens_per_s']} tokens/s over {r['decoded_tokens']} tokens",
        f"KV bytes in use at peak: {used:,} against the plan's {planned:,} ({used / planned:.3f}x; "
        f"plan {r['kv_bytes_per_token_planned']} B/token)",
    ])

if __name__ == "__main__":
    sys.exit(main())
