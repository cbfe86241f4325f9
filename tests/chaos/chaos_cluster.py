"""The cluster the chaos suite and ``bench/soak.py`` break: its shape, the faults done to it, and
which failed answers each fault excuses (its ``FaultPolicy``), with why.

    kill_and_restart(cluster, name)   SIGKILL a service, leave it dead a moment, start it again
    restart_etcd(cluster, down_s)     etcd stopped for ``down_s``, started on the same URL and data
    freeze_etcd(cluster, frozen_s)    etcd paused (SIGSTOP): on waking it revokes expired leases
"""

from __future__ import annotations

import asyncio
import signal

from chaos_outcomes import FaultPolicy

from kvfleet.cli.local_cluster import DEMO_TENANTS, LocalCluster

BLOCK_SIZE = 16
KV_CACHE_MEMORY = 16 << 20  # 512 blocks of 16 tokens per node (32 KiB each on the tiny model)
LEASE_TTL_S = 2
# gold and free (the demo's) and a small tenant: 1 MiB is 32 blocks (512 tokens) per node
TENANTS = DEMO_TENANTS + """\
  - name: small
    api_key: sk-small
    quota_mib: 1
    paid_level: 0
    max_concurrent: 4
"""
SMALL_QUOTA_TOKENS = 512
DOWN_S = 1.5  # how long a killed process stays dead before it is started again

# A request is never lost to a dead block_service: the KV lives on the node and only the
# bookkeeping waits (docs/design.md "Staying alive": retry with backoff, hold what cannot proceed).
# A request arriving while no node can take work may hear UNAVAILABLE "no READY compute node",
# the documented answer, before its first token; a stream already flowing must not break.
BLOCK_SERVICE_DOWN = FaultPolicy(
    "block_service down", "no READY node may be an answer to new requests; no stream breaks",
    excused=frozenset({"UNAVAILABLE"}))
# A dead node's requests are retried (before the first token) or resumed (after it) on the other
# node: README "The cluster", router. With one node left there is always a READY node: no excuse.
NODE_DOWN = FaultPolicy("a node down", "the router retries or resumes a dead node's requests elsewhere")
# The router is the client's only door: its death breaks every open call, and calls while it is
# down cannot connect. The client sees UNAVAILABLE, at any point of a stream (and retries).
ROUTER_DOWN = FaultPolicy("the router down", "the door itself was gone: every open call broke",
                          excused=frozenset({"UNAVAILABLE"}), mid_stream=True)
# etcd carries membership, not tokens: serving goes on while it is down. When it is back the
# nodes' leases may have lapsed until they register again, so a new request may hear "no READY
# compute node" before its first token; a node that stayed alive keeps its streams.
ETCD_DOWN = FaultPolicy("etcd down", "membership may lapse for new requests; streams on live nodes go on",
                        excused=frozenset({"UNAVAILABLE"}))


def start_cluster(model_dir, work_dir, num_nodes: int = 2, dtype: str = "float32", **kw) -> LocalCluster:
    """``kw``: LocalCluster's own (roles, router_args); the nodes compute in ``dtype`` (float32: the
    suite's references are exact there; the soak measures bfloat16 too)."""
    tenants = work_dir / "tenants.yaml"
    tenants.write_text(TENANTS)
    cluster = LocalCluster(model_dir, num_nodes, tenants_file=tenants, work_dir=work_dir, block_size=BLOCK_SIZE,
                           kv_cache_memory=KV_CACHE_MEMORY, dtype=dtype,
                           compute_args=("--lease-ttl", str(LEASE_TTL_S)), **kw)
    return cluster.start()


# Restarts happen on the event loop's thread, never in a worker thread: Linux sends a child the
# parent-death signal when the *thread* that started it exits, so a child started from
# ``asyncio.to_thread`` dies with that worker.


async def kill_and_restart(cluster: LocalCluster, name: str, down_s: float = DOWN_S) -> None:
    """Returns once the child is started again, not once it serves (the checker waits for that)."""
    cluster.kill(name)
    await asyncio.sleep(down_s)
    cluster.restart(name)


async def restart_etcd(cluster: LocalCluster, down_s: float = LEASE_TTL_S + 3) -> None:
    """A clean stop (SIGTERM), ``down_s`` down, started again on the same URL and data."""
    cluster.etcd.process.terminate()
    await asyncio.to_thread(cluster.etcd.process.wait)
    await asyncio.sleep(down_s)
    cluster.restart("etcd")


async def freeze_etcd(cluster: LocalCluster, frozen_s: float = LEASE_TTL_S + 3) -> None:
    """A restarted etcd renews every lease; a frozen one, on waking, revokes those that expired
    before it reads their keep-alives: every node's lease lapses while the nodes live on."""
    cluster.etcd.process.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(frozen_s)
    finally:
        cluster.etcd.process.send_signal(signal.SIGCONT)
