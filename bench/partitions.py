"""Partitions, not crashes: a cluster with each service in its own network namespace (etcd, two
block_service replicas, two nodes, the router), links cut, cut one way or made lossy while clients
record every acknowledged page-table change and every streamed token; then the heal and the checker
(``kvfleet.cli.partition``). As root (``ip netns``, ``iptables``). The lossy soak's delay is ``tc netem``
where the kernel has it, else a userspace TCP delay proxy per namespace (JSON ``delay_mechanism``).

Per scenario, and summed at the top level (goal: every total 0 but ``unavailable_s``, near one lease
TTL per leadership change):

    lost_acknowledged   acknowledged allocations missing (or changed) after the heal
    double_grants       a block granted to two live sequences
    split_brain_writes  acknowledgements by one replica inside the other's term
    wrong_tokens        streamed tokens lost, repeated or different from the fault-free float32 run
    over_quota          samples of a tenant over its quota
    unavailable_s       the longest a client (page-table or streams) went without service: gaps over
                        1 s, plus the injected delay once per delayed leg of its longest wait where a
                        scenario delays every service (``checker.stall_thresholds``; JSON ``stall_s``)
    unavailable_raw_s   the same at a flat 1 s (nothing hidden by the thresholds)

    python bench/partitions.py [--quick] [--json] [--scenario NAME ...] [--repeat N] [--history-dir DIR]
                               [--lease-ttl 3] [--soak-s 300]

Every run's history (each write, stream and quota sample, with times) is saved as JSON under
``--history-dir`` (default: the run's work directory), and each violation comes with its records.
The scenarios of a three-member etcd (``ETCD_MEMBER_SCENARIOS``: one member cut off) run on a bed of
their own, started after the one-member bed's scenarios.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, ensure_model  # noqa: E402

FULL = dict(soak_s=300.0, max_tokens=24)
QUICK = dict(soak_s=30.0, max_tokens=16)
SMOKE_SCENARIOS = ["node_cut_from_router"]


def _line(name: str, r: dict) -> str:
    return (f"  {name:28s} lost {r['lost_acknowledged']:3d}  double {r['double_grants']:3d}  split {r['split_brain_writes']:3d}"
            f"  wrong {r['wrong_tokens']:3d}  over_quota {r['over_quota']:3d}  unavailable {r['unavailable_s']:6.2f} s"
            f" (raw {r['unavailable_raw_s']:.2f} s)"
            f"  (leader {r['leader_before']}→{r['leader_after']}, {r['acknowledged_writes']} acked writes, "
            f"{r['streams']} streams, {r['failed_streams']} failed{', exited ' + str(r['exited']) if r['exited'] else ''})")


def _run_bed(args, model: Path, work: Path, etcd_members: int, chosen: list, max_tokens: int, soak_s: float,
             history_dir: Path) -> dict[str, dict]:
    """Each of ``chosen`` (``--repeat`` times) on one bed whose etcd has ``etcd_members`` members."""
    from kvfleet.cli.partition import scenarios
    from kvfleet.cli.partition.bed_cluster import BedCluster
    from kvfleet.cli.partition.history import StreamClients

    results: dict[str, dict] = {}
    with BedCluster(model, work / f"cluster-etcd{etcd_members}", work / "tenants.yaml", lease_ttl_s=args.lease_ttl,
                    etcd_members=etcd_members) as cluster:
        prompt_list = scenarios.prompts()
        reference = StreamClients(cluster.router_address, prompt_list, max_tokens).reference()
        for scenario in chosen:
            for k in range(args.repeat):
                key = scenario.name if args.repeat == 1 else f"{scenario.name}#{k}"
                results[key] = scenarios.run_scenario(cluster, scenario, reference, prompt_list, max_tokens,
                                                      soak_s=soak_s, history_dir=history_dir)
                if not args.json:
                    print(_line(key, results[key]), flush=True)
                    for kind, found in results[key]["violations"].items():
                        for v in found:
                            print(f"    {kind}: {json.dumps(v)}", flush=True)
    return results


def main() -> int:
    from kvfleet.cli.partition import checker, netns, scenarios

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 30 s soak instead of 5 minutes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    every = {**scenarios.SCENARIOS, **scenarios.ETCD_MEMBER_SCENARIOS}
    parser.add_argument("--scenario", action="append", choices=sorted(every), help="only these")
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario N times (results NAME#k)")
    parser.add_argument("--history-dir", type=Path, default=None, help="save each run's history here as JSON")
    parser.add_argument("--lease-ttl", type=int, default=3, help="the block_service leader lease (default 3 s)")
    parser.add_argument("--soak-s", type=float, default=None, help="the lossy soak's length (default 300, quick 30)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick or args.smoke else FULL)
    names = args.scenario or (SMOKE_SCENARIOS if args.smoke else list(every))
    soak_s = args.soak_s if args.soak_s is not None else cfg["soak_s"]
    reason = netns.why_unavailable()
    if reason:
        if args.json:
            print(json.dumps({"skipped": reason}))
            return 0
        print(f"partitions: cannot make network namespaces here: {reason}", file=sys.stderr)
        return 2
    model = ensure_model("tiny", ROOT / "models" / "soak-tiny")
    from kvfleet.cli.partition.bed_cluster import BED_TENANTS

    work = Path(tempfile.mkdtemp(prefix="kvfleet-partitions-"))
    history_dir = args.history_dir or work / "histories"
    (work / "tenants.yaml").write_text(BED_TENANTS)
    results: dict[str, dict] = {}
    started = time.monotonic()
    for members, table in ((1, scenarios.SCENARIOS), (3, scenarios.ETCD_MEMBER_SCENARIOS)):
        on_this_bed = [n for n in names if n in table]
        if on_this_bed:
            results |= _run_bed(args, model, work, members, [table[n] for n in on_this_bed], cfg["max_tokens"],
                                soak_s, history_dir)
    out = {**checker.totals(results), "scenarios": results, "lease_ttl_s": args.lease_ttl, "soak_s": soak_s,
           "delay_mechanism": netns.delay_mechanism(),
           "wall_s": round(time.monotonic() - started, 1), "logs": str(work),
           "histories": str(history_dir)}
    if args.json:
        print(json.dumps(out))
    else:
        print("totals: " + "  ".join(f"{k} {out[k]}" for k in (*checker.KEYS, checker.RAW_KEY))
              + f"   (logs: {out['logs']}, histories: {out['histories']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
