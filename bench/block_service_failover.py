"""block_service failover: SIGKILL the leader under streaming load; how long until the standby
serves, and is anything lost or failed?

A local cluster with two block_service replicas (``--block-service-standby``: a leader and a
standby with ``--sync-standby``, electing through the cluster's etcd), compute nodes and a router.
Clients stream greedy requests through the router without pause; a probe (the bench's own node,
with a node certificate of its own under the cluster's CA, following the leader through etcd like
the nodes do) makes block_service changes one after another (an allocation with prefix hashes, then
the commit of its full blocks) and records each one block_service acknowledged; what the leader holds
is read back as admin (GetSequences is admin's). Then the leader is SIGKILLed (no resignation: its lease must lapse).

    takeover_s       kill → the first probe change the new leader acknowledged
    lost_records     probe changes acknowledged before the kill that the new leader does not hold
    failed_requests  router streams that ended in an error (the nodes ride out the gap)
    takeover_per_ttl takeover_s over the lease TTL (the floor of a takeover by lease expiry)
    sync_write_cost  the probe's median change latency with the standby in sync, over the same after
                     the takeover (the new leader alone: durable locally only), in the same run

    python bench/block_service_failover.py [--quick] [--json] [--lease-ttl 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model, seeded_prompts  # noqa: E402

FULL = dict(clients=4, warm_s=10.0, after_s=10.0, new_tokens=48)
QUICK = dict(clients=2, warm_s=4.0, after_s=4.0, new_tokens=24)
SMOKE = dict(clients=1, warm_s=0.5, after_s=0.5, new_tokens=2, nodes=1, lease_ttl=3)  # the nodes and TTL too
PROBE_NODE = "failover-probe"


class RouterLoad:
    """Client threads that stream requests through the router until told to stop."""

    def __init__(self, address: str, clients: int, new_tokens: int) -> None:
        self.address, self.new_tokens = address, new_tokens
        self.prompts = seeded_prompts(64, 16, 96, seed=3)
        self.done = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)

    def _client(self, i: int) -> None:
        import grpc

        from kvfleet.v1 import inference_pb2, inference_pb2_grpc

        n = i
        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            while not self._stop.is_set():
                req = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(
                    max_tokens=self.new_tokens, ignore_eos=True))
                req.tokens.ids.extend(self.prompts[n % len(self.prompts)])
                n += len(self._threads)
                try:
                    for _ in stub.Generate(req, metadata=[("authorization", "Bearer sk-gold")], timeout=300):
                        pass
                    with self._lock:
                        self.done += 1
                except grpc.RpcError as e:
                    with self._lock:
                        self.failed += 1
                        self.errors.append(f"{e.code().name}: {e.details()}")


def node_credentials(cluster, node_id: str):
    """A node certificate for ``node_id`` under the cluster's CA, issued as the cluster issues its nodes'
    (only ``node:<id>`` may register and change its own pool), or None when the cluster is plaintext."""
    if cluster.certs.root is None:
        return None
    from kvfleet.core import certs
    from kvfleet.core.identity import Identity
    from kvfleet.core.tls import Credentials

    identity = Identity.node(node_id)
    certs.ensure(cluster.certs.root, [identity])
    return Credentials.load(certs.identity_dir(cluster.certs.root, identity), identity)


class Probe:
    """Block changes one after another as node ``PROBE_NODE``, on the leader the admin client follows via etcd."""

    def __init__(self, client, admin, block_size: int) -> None:
        self.client, self.admin, self.block_size = client, admin, block_size
        self.acknowledged: dict[str, list[int]] = {}   # seq → its block table, once its commit was acknowledged
        self.latencies: list[tuple[float, float]] = []  # (when, seconds) of each acknowledged change
        self.n = 0

    async def change(self) -> bool:
        """One allocation and its commit; True once both were acknowledged."""
        from kvfleet.core.allocator import AllocateRequest, Allocation

        if self.admin.target:
            self.client.retarget(self.admin.target)
        seq = f"probe-{self.n}"
        hashes = [self.n.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(2)]
        started = time.monotonic()
        try:
            [result] = await self.client.allocate_many(
                [AllocateRequest(PROBE_NODE, seq, "gold", hashes, 2 * self.block_size)])
            if not isinstance(result, Allocation):
                raise RuntimeError(f"refused: {result}")
            await self.client.commit([(seq, i, h) for i, h in enumerate(hashes)])
        except Exception:
            if seq in {s.seq_id for s in await self._known([seq])}:
                await self._release(seq)  # half done on the old leader: start the next one clean
            self.n += 1
            return False
        done = time.monotonic()
        self.acknowledged[seq] = result.block_ids
        self.latencies.append((done, done - started))
        self.n += 1
        return True

    async def _known(self, seqs):
        try:
            return await self.admin.sequences(seqs)
        except Exception:
            return []

    async def _release(self, seq: str) -> None:
        try:
            await self.client.release([seq])
        except Exception:
            pass

    async def lost(self) -> int:
        """Acknowledged changes the current leader does not hold (its table, both blocks committed)."""
        held = {s.seq_id: s for s in await self.admin.sequences(list(self.acknowledged))}
        return sum(1 for seq, blocks in self.acknowledged.items()
                   if seq not in held or held[seq].block_ids != blocks or held[seq].num_committed != 2)


async def _run(cluster, cfg: dict, stop_load, old: str) -> dict:
    """Warm up, kill the leader ``old``, measure the takeover, carry on, then count what was lost."""
    from kvfleet.block_service import leader_client
    from kvfleet.block_service.client import BlockManagerClient

    admin = await leader_client.connect("etcd", cluster.etcd.url, timeout_s=2.0)  # this process's: admin
    client = BlockManagerClient(admin.target, timeout_s=2.0, credentials=node_credentials(cluster, PROBE_NODE))
    try:
        await client.register_node(PROBE_NODE, 1 << 16, cluster.block_size, 1 << 10)
        probe = Probe(client, admin, cluster.block_size)
        deadline = time.monotonic() + cfg["warm_s"]
        while time.monotonic() < deadline:
            await probe.change()
        before = len(probe.acknowledged)
        killed = time.monotonic()
        cluster.kill("block_service")
        while not await probe.change():
            await asyncio.sleep(0.02)
        takeover_s = time.monotonic() - killed
        new = admin.target
        deadline = time.monotonic() + cfg["after_s"]
        while time.monotonic() < deadline:
            await probe.change()
        stop_load()
        before_kill = dict(list(probe.acknowledged.items())[:before])
        probe.acknowledged, everything = before_kill, probe.acknowledged
        lost_before_kill = await probe.lost()
        probe.acknowledged = everything
        sync_lat = [s for t, s in probe.latencies if t < killed]
        alone_lat = [s for t, s in probe.latencies if t > killed + takeover_s + 0.5]
        return dict(takeover_s=takeover_s, lost_records=lost_before_kill, lost_records_all=await probe.lost(),
                    acknowledged_before_kill=before, acknowledged=len(everything), old_leader=old, new_leader=new,
                    sync_change_ms_p50=statistics.median(sync_lat) * 1e3,
                    alone_change_ms_p50=statistics.median(alone_lat) * 1e3 if alone_lat else None)
    finally:
        await client.close()
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (a few minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--lease-ttl", type=int, default=5, help="the block_service leader lease (default 5 s)")
    parser.add_argument("--nodes", type=int, default=2)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.nodes, args.lease_ttl = SMOKE["nodes"], SMOKE["lease_ttl"]
    if args.lease_ttl < 2 or args.nodes < 1:
        parser.error("--lease-ttl must be at least 2 and --nodes at least 1")
    cfg = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    model = ensure_model("tiny", ROOT / "models" / "soak-tiny")

    from kvfleet.cli.local_cluster import LocalCluster

    with LocalCluster(model, num_nodes=args.nodes, block_size=16, kv_cache_memory=32 << 20, log_level="INFO",
                      block_service_standby=True, lease_ttl_s=args.lease_ttl, metrics=False) as cluster:
        load = RouterLoad(cluster.router_address, cfg["clients"], cfg["new_tokens"])
        load.start()
        result = asyncio.run(_run(cluster, cfg, load.stop, cluster.block_service_address))
        result.update(failed_requests=load.failed, completed_requests=load.done, errors=load.errors[:5],
                      lease_ttl_s=args.lease_ttl, nodes=args.nodes, clients=cfg["clients"], logs=str(cluster.work_dir))
    result["takeover_per_ttl"] = result["takeover_s"] / args.lease_ttl
    alone = result["alone_change_ms_p50"]
    result["sync_write_cost"] = result["sync_change_ms_p50"] / alone if alone else None
    if args.json:
        print(json.dumps({**result, "dtype": engine_dtype()}))  # the nodes' (auto, resolved here alike)
        return
    print(f"{args.nodes} nodes, {cfg['clients']} streaming clients, lease TTL {args.lease_ttl} s, "
          f"leader {result['old_leader']} SIGKILLed → {result['new_leader']}")
    print(f"  takeover           {result['takeover_s']:6.2f} s   ({result['takeover_per_ttl']:.2f} × the lease TTL; goal ≤ 10 s)")
    print(f"  lost records       {result['lost_records']} of {result['acknowledged_before_kill']} acknowledged "
          f"before the kill (goal 0); {result['lost_records_all']} of {result['acknowledged']} in all")
    print(f"  failed requests    {result['failed_requests']} of {result['failed_requests'] + result['completed_requests']}"
          f" (goal 0)")
    if alone:
        print(f"  a probe change: {result['sync_change_ms_p50']:.1f} ms with the sync standby, {alone:.1f} ms alone "
              f"(× {result['sync_write_cost']:.2f})")


if __name__ == "__main__":
    main()
