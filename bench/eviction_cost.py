"""What an eviction policy costs the page table, in process, at two pool sizes: a pool full of
cached blocks, then requests that each revive a cached prefix (a hit), take fresh blocks by
evicting, commit and release (caching them again). Per policy and pool size: microseconds per
block moved, and per request; flat from 10,000 to 100,000 blocks when no operation is
O(cached blocks) — the figure this exists for is ``growth`` (per-block time at the large pool /
at the small one; 1.0 is flat), against ``lru`` measured in the same run.

    python bench/eviction_cost.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_smoke_flag  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402
from kvfleet.block_service.eviction import NAMES  # noqa: E402
from kvfleet.block_service.page_table import PageTable  # noqa: E402
from kvfleet.core.allocator import AllocateRequest  # noqa: E402
from kvfleet.core.tenants import MIB, Tenant  # noqa: E402

BS, BPB, CHAIN = 16, MIB // 4, 32
TENANTS = [Tenant(f"t{i}", cache_share_mib=8 * (i + 1)) for i in range(4)] + [Tenant("flood")]


def _hashes(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def measure(policy: str, num_blocks: int, requests: int, seed: int = 0) -> dict:
    table = PageTable(policy)
    table.register_node("n", num_blocks, BS, BPB)
    table.configure_tenants(TENANTS)
    rng = random.Random(seed)
    names = [t.name for t in TENANTS]
    count = 0

    def request(tenant: str, hashes: list[bytes]) -> None:
        nonlocal count
        count += 1
        seq = f"s{count}"
        table.allocate_many([AllocateRequest("n", seq, tenant, hashes, len(hashes) * BS)])
        table.commit([(seq, i, h) for i, h in enumerate(hashes)])
        table.release([seq])

    prompts = []
    for k in range(num_blocks // CHAIN):  # fill the pool with cached blocks
        tenant = names[k % len(names)]
        prompts.append((tenant, _hashes(f"fill-{k}", CHAIN)))
        request(*prompts[-1])
    start = time.process_time()
    moved = 0
    for k in range(requests):
        tenant, old = prompts[rng.randrange(len(prompts))]
        hashes = old[:CHAIN // 2] + _hashes(f"new-{k}", CHAIN // 2)  # half a hit, half evicted and cached anew
        request(tenant, hashes)
        moved += CHAIN
    seconds = time.process_time() - start
    assert table.node_stats("n").num_cached > num_blocks // 2
    return dict(us_per_block=round(1e6 * seconds / moved, 3), us_per_request=round(1e6 * seconds / requests, 1),
                evictions=sum(table.node_stats("n").counters.evictions.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    add_smoke_flag(parser)
    args = parser.parse_args()
    requests = 20 if args.smoke else 300 if args.quick else 2000
    sizes = (1_000, 10_000) if args.smoke else (10_000, 100_000)
    results = {}
    for policy in NAMES:
        small, large = (measure(policy, n, requests) for n in sizes)
        results[policy] = dict(small=small, large=large,
                               growth=round(large["us_per_block"] / small["us_per_block"], 2))
    for policy in NAMES:
        results[policy]["vs_lru_large"] = round(results[policy]["large"]["us_per_block"]
                                                / results["lru"]["large"]["us_per_block"], 2)
    out = dict(policies=results, sizes=list(sizes), requests=requests, chain_blocks=CHAIN, cpu=cpu_model())
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{cpu_model()}; {requests} requests of {CHAIN} blocks (half hit, half evicted) on a full pool")
        print("| policy | µs/block at 10k | µs/block at 100k | growth | vs lru at 100k |")
        print("|---|---:|---:|---:|---:|")
        for p, r in results.items():
            print(f"| {p} | {r['small']['us_per_block']} | {r['large']['us_per_block']} | {r['growth']} | "
                  f"{r['vs_lru_large']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
