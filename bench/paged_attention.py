"""Paged decode attention on CPU against contiguous SDPA, gather-then-SDPA and a plain read of the KV.

For each shape and block size, on identical KV (float32), in interleaved rounds (noise hits all four):
  (a) paged   — ``kernels.paged_decode`` (the native CPU kernel through the engine's dispatch)
  (b) sdpa    — ``scaled_dot_product_attention`` on contiguous [batch, kv_heads, context, head_dim] K/V
  (c) gather  — copy the sequence's blocks out of the pool, then (b)
  (d) read    — ``sum`` over the pool's K and V: the bytes (a) must read, at the machine's read speed
Prints each time (best of the rounds), the KV GB/s, ratio = (b)/(a) and fraction = (d)/(a), the share of
measured read bandwidth that (a) reaches. ``--json`` prints one object whose ``ratio`` and
``bandwidth_fraction`` are those of block_size 256 on the first shape. ``--prefill`` adds CPU prefill:
the dispatch's native causal kernel against the GEMM path it replaced and the SDPA reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_smoke_flag  # noqa: E402
from kvfleet import kernels  # noqa: E402
from kvfleet.kernels import cpu_kernels  # noqa: E402
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache  # noqa: E402

SHAPES = [  # (batch, num_heads, num_kv_heads, head_dim, context)
    (8, 32, 8, 128, 16384),
    (4, 32, 8, 128, 32768),
]
SMOKE_SHAPES = [(2, 32, 8, 128, 1024), (1, 32, 8, 128, 2048)]  # --smoke: it runs, no figure
BLOCK_SIZES = [16, 64, 256, 1024]


def timed(fn, rounds: list[float]) -> None:
    start = time.perf_counter()
    fn()
    rounds.append(time.perf_counter() - start)


def paged_pool(dense: torch.Tensor, block_size: int, perm: torch.Tensor) -> torch.Tensor:
    """Scatter dense [batch, kv_heads, context, head_dim] into a shuffled pool of blocks."""
    batch, num_kv_heads, context, head_dim = dense.shape
    blocks = dense.view(batch, num_kv_heads, context // block_size, block_size, head_dim)
    blocks = blocks.permute(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, block_size, head_dim)
    pool = torch.empty_like(blocks)
    pool[perm] = blocks  # sequence b's j-th block lands at pool[perm[b * n + j]]
    return pool


def run_shape(shape, block_sizes, rounds: int, gather_rounds: int) -> list[dict]:
    batch, num_heads, num_kv_heads, head_dim, context = shape
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen)
    v = torch.randn(batch, num_kv_heads, context, head_dim, generator=gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    params = AttentionParams(scale)
    kv_bytes = 2 * k.numel() * k.element_size()
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
    expected = sdpa()[:, :, 0]
    rows = []
    for block_size in block_sizes:
        num_blocks = batch * context // block_size
        perm = torch.randperm(num_blocks, generator=gen)
        k_cache, v_cache = paged_pool(k, block_size, perm), paged_pool(v, block_size, perm)
        tables = perm.view(batch, -1).to(torch.int32)
        cache, meta = LayerCache(k_cache, v_cache), AttentionMetadata.decode_only(tables, context_lens)
        paged = lambda: kernels.paged_decode(q, cache, meta, params)  # noqa: E731

        def gather():
            ids = tables.flatten().long()
            kg, vg = (
                c.index_select(0, ids).view(batch, -1, num_kv_heads, block_size, head_dim)
                .transpose(1, 2).reshape(batch, num_kv_heads, context, head_dim)
                for c in (k_cache, v_cache)
            )
            return F.scaled_dot_product_attention(q[:, :, None], kg, vg, scale=scale, enable_gqa=True)

        read = lambda: (k_cache.sum(), v_cache.sum())  # noqa: E731
        torch.testing.assert_close(paged(), expected, rtol=1e-4, atol=1e-5)
        times = {"paged": [], "sdpa": [], "gather": [], "read": []}
        read()
        for i in range(rounds):  # interleaved, so that a noisy moment hits every contender
            timed(paged, times["paged"])
            timed(read, times["read"])
            timed(sdpa, times["sdpa"])
            if i < gather_rounds:
                timed(gather, times["gather"])
        t = {name: min(ts) for name, ts in times.items()}
        rows.append({
            "batch": batch, "context": context, "block_size": block_size,
            **{f"{name}_ms": round(sec * 1e3, 2) for name, sec in t.items()},
            **{f"{name}_gbps": round(kv_bytes / sec / 1e9, 1) for name, sec in t.items()},
            "ratio": round(t["sdpa"] / t["paged"], 2),
            "gather_ratio": round(t["gather"] / t["paged"], 2),
            "bandwidth_fraction": round(t["read"] / t["paged"], 2),
        })
        del k_cache, v_cache, cache
    return rows


PREFILL_HEADS = [(32, 8, 128), (12, 4, 64)]  # (query heads, KV heads, head_dim): an 8B-class layer, bench-small's


def run_prefill(prompt_lens: list[int], rounds: int) -> list[dict]:
    """CPU prefill of whole prompts, same KV: the dispatch (the native causal kernel), the GEMM path
    it replaced, and SDPA over the gathered K/V, in interleaved rounds."""
    from unittest import mock

    from kvfleet.kernels import cpu_prefill
    from kvfleet.kernels.reference import gather_kv
    from kvfleet.kernels.testing import make_case

    rows = []
    for heads, kv_heads, head_dim in PREFILL_HEADS:
        for prompt in prompt_lens:
            case = make_case([prompt], q_lens=[prompt], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             block_size=256)
            table, cache = case.meta.prefill_block_tables[0], case.cache

            def gemm():
                with mock.patch.object(cpu_kernels, "supports_prefill", lambda query, cache: False):
                    return cpu_prefill.cpu_paged_prefill(*case.args())

            paths = {
                "native": lambda: cpu_prefill.cpu_paged_prefill(*case.args()),  # noqa: B023
                "gemm": gemm,
                "sdpa": lambda: F.scaled_dot_product_attention(  # noqa: B023
                    case.query.transpose(0, 1), gather_kv(cache.k, table, prompt, None),  # noqa: B023
                    gather_kv(cache.v, table, prompt, None), is_causal=True, scale=case.params.scale,  # noqa: B023
                    enable_gqa=True),
            }
            for fn in paths.values():
                fn()  # warm-up: the first calls of a shape cost several times more
            times = {name: [] for name in paths}
            for _ in range(rounds):
                for name, fn in paths.items():
                    timed(fn, times[name])
            best = {name: min(t) for name, t in times.items()}
            rows.append({"heads": f"{heads}/{kv_heads}x{head_dim}", "prompt": prompt,
                         **{f"{name}_ms": round(t * 1e3, 1) for name, t in best.items()},
                         "ratio": round(best["sdpa"] / best["native"], 2),
                         "gemm_ratio": round(best["gemm"] / best["native"], 2)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| batch | context | block | paged ms (GB/s) | sdpa ms (GB/s) | gather+sdpa ms (GB/s) "
          "| read ms (GB/s) | sdpa/paged | gather/paged | paged/read bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[f'{n}_ms']:.1f} ({r[f'{n}_gbps']:.1f})" for n in ("paged", "sdpa", "gather", "read")]
        print(f"| {r['batch']} | {r['context']} | {r['block_size']} | " + " | ".join(cells)
              + f" | {r['ratio']:.2f}× | {r['gather_ratio']:.2f}× | {r['bandwidth_fraction']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds; the long shape at block 256 only")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--prefill", action="store_true",
                        help="also time CPU prefill: the native kernel against the GEMM path and SDPA")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if not cpu_kernels.load_extension():
        sys.exit("the native CPU kernel did not build; nothing to measure")
    rounds, gather_rounds = (1, 1) if args.smoke else (3, 1) if args.quick else (10, 3)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = run_shape(shapes[0], [256] if args.smoke else BLOCK_SIZES, rounds, gather_rounds)
    rows += run_shape(shapes[1], [256] if args.quick or args.smoke else BLOCK_SIZES, rounds, gather_rounds)
    headline = next(r for r in rows if r["block_size"] == 256)
    prefill = run_prefill([512, 2048], 2 if args.quick else 5) if args.prefill else []
    if args.json:
        print(json.dumps({
            "dtype": "float32", "ratio": headline["ratio"], "bandwidth_fraction": headline["bandwidth_fraction"],
            "threads": torch.get_num_threads(), "rows": rows, "prefill": prefill,
        }))
        return
    print(f"float32, {SHAPES[0][1]} query / {SHAPES[0][2]} KV heads, head_dim {SHAPES[0][3]}, "
          f"{torch.get_num_threads()} threads, best of {rounds} interleaved rounds "
          f"(gather: {gather_rounds}); KV GB/s = K+V bytes / time")
    print_table(rows)
    print(f"block_size 256, first shape: paged is {headline['ratio']:.2f}× faster than contiguous SDPA "
          f"and reaches {headline['bandwidth_fraction']:.0%} of the measured read bandwidth")
    if prefill:
        print("\nCPU prefill of one whole prompt: the native causal kernel (the dispatch) against the GEMM path "
              "and SDPA over the gathered K/V")
        print("| heads | prompt | native ms | gemm ms | sdpa ms | gemm/native | sdpa/native |\n|---|---|---|---|---|---|---|")
        for r in prefill:
            print(f"| {r['heads']} | {r['prompt']} | {r['native_ms']:.1f} | {r['gemm_ms']:.1f} | {r['sdpa_ms']:.1f} "
                  f"| {r['gemm_ratio']:.2f}× | {r['ratio']:.2f}× |")


if __name__ == "__main__":
    main()
