"""After a fault: is the cluster whole again, and did every client get what the contract promises?

``ClusterChecker(cluster, book).check(policy, outcomes, restarted)`` runs every check and returns
every broken promise, one line each (a failing test shows them all, not just the first):

    processes    each child alive, and the same process unless the fault restarted it (a node
                 that died and came back is still a death)
    health       gRPC health SERVING for each service (Inference, BlockManager, Compute); every node
                 READY in etcd                                                    (polled)
    probe        a greedy request's tokens equal its prompt's reference from before the fault
    no leak      block_service holds no sequence and no used block beyond the baseline once the
                 requests have ended; each node counts the same blocks as block_service  (polled)
    durability   the state directory replays (``kvfleet.block_service.durable.recover``) to a page table
                 whose invariants hold (``PageTable.check``), no shorter than the log position
                 block_service acknowledged before the fault, and equal to the one it reports now
    clients      each outcome's status allowed by its spec or excused by the fault's policy, and
                 its tokens exactly its prompt's reference (a prefix, when it did not finish)
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from chaos_load import PromptBook, send
from chaos_outcomes import (
    OK,
    Outcome,
    Policies,
    RequestSpec,
    token_violation,
    violations,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.block_service.durable import recover
from kvfleet.core import rpc
from kvfleet.core.identity import BLOCK_SERVICE_ID, Identity
from kvfleet.v1 import (
    block_manager_pb2,
    block_manager_pb2_grpc,
    compute_pb2,
    compute_pb2_grpc,
    inference_pb2_grpc,
)

# How long a recovery may take before it is a failure: serving again (a restarted node loads its
# model and warms up: 20-30 s seen on a busy 2-core machine), and releasing every block once the
# requests have ended.
HEALTH_S = 90.0
SETTLE_S = 20.0
POLL_S = 0.2


@dataclass(slots=True)
class Baseline:
    pids: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)  # node id → blocks in use at rest
    log_records: int = 0                                 # block_service's acknowledged log position


class ClusterChecker:
    def __init__(self, cluster, book: PromptBook, probe_key: str = "sk-gold", probe_prompt: str | None = None,
                 probe_tokens: int = 24):
        self.cluster = cluster
        self.book = book
        self.probe = RequestSpec("probe", probe_key, probe_prompt or next(iter(book.prompts)), probe_tokens)
        self.base = Baseline()

    # -- what the cluster looks like at rest -----------------------------------------------------------

    def pids(self) -> dict[str, int]:
        pids = {c.name: c.process.pid for c in self.cluster.children()}
        if self.cluster.etcd.process is not None:
            pids["etcd"] = self.cluster.etcd.process.pid
        return pids

    async def baseline(self) -> Baseline:
        """Record the cluster at rest before a fault (call when no request is in flight)."""
        nodes, log_records = await self._block_stats()
        self.base = Baseline(self.pids(), {n.node_id: n.num_used for n in nodes}, log_records)
        return self.base

    async def _block_stats(self) -> tuple[list, int]:
        """block_service's pools (``NodePoolStats``) and its acknowledged log position."""
        async with rpc.channel(self.cluster.block_service_address, peer=BLOCK_SERVICE_ID) as channel:
            resp = await block_manager_pb2_grpc.BlockManagerStub(channel).Stats(
                block_manager_pb2.BlockStatsRequest(), timeout=5)
        return list(resp.nodes), resp.log_records

    # -- the checks ------------------------------------------------------------------------------------

    async def check(self, policy: Policies, outcomes: list[Outcome],
                    restarted: frozenset[str] = frozenset()) -> list[str]:
        """Every check; ``restarted`` names the children the fault started again on purpose."""
        problems = self.check_processes(restarted)
        problems += await self.check_health()
        problems += await self.check_probe()
        problems += await self.check_no_leak()
        problems += await self.check_durability()
        problems += violations(outcomes, self.book.references, policy)
        return problems

    def check_processes(self, restarted: frozenset[str] = frozenset()) -> list[str]:
        problems = []
        now = self.pids()
        for child in self.cluster.children():
            if not child.alive():
                problems.append(f"{child.name} is dead (exit {child.process.returncode}); its last errors:\n"
                                f"{_indent(last_errors(child.log_tail(200)))}")
            elif child.name not in restarted and now.get(child.name) != self.base.pids.get(child.name):
                problems.append(f"{child.name} was restarted (pid {self.base.pids.get(child.name)} → "
                                f"{now.get(child.name)}): it died during the fault")
        if "etcd" not in now:
            problems.append("etcd is not running")
        return problems

    def _addresses(self) -> dict[str, tuple[str, str, Identity | None]]:
        """Process name → (address, the gRPC service whose health says it serves, its identity:
        None for the router's public door)."""
        c = self.cluster
        out = {"router": (c.router_address, "kvfleet.v1.Inference", None),
               "block_service": (c.block_service_address, "kvfleet.v1.BlockManager", BLOCK_SERVICE_ID)}
        out.update({name: (f"127.0.0.1:{child.port}", "kvfleet.v1.Compute", Identity.node(name))
                    for name, child in c.nodes.items()})
        return out

    def _all_alive(self) -> bool:
        return all(c.alive() for c in self.cluster.children())

    async def check_health(self) -> list[str]:
        """Health SERVING on every live child and every live node READY in etcd, polled up to
        ``HEALTH_S``; no waiting for what cannot change (no health service, a router whose nodes
        are all dead: nothing here restarts them, and their deaths are reported already)."""
        deadline = time.monotonic() + HEALTH_S
        while True:
            alive = {c.name for c in self.cluster.children() if c.alive()}
            status = {name: await _health(*a) for name, a in self._addresses().items() if name in alive}
            try:
                states = await asyncio.to_thread(self.cluster.node_states)
            except Exception as e:  # etcd unreachable is itself the finding
                states = {"(etcd)": f"unreachable: {e}"}
            bad = {name: f"{name} health {s}" for name, s in status.items() if s != "SERVING"}
            final = {n for n, s in status.items() if s in ("UNIMPLEMENTED", "NOT_FOUND")}
            if not alive & set(self.cluster.nodes):
                final.add("router")
            bad.update({f"etcd {n}": f"{n} is {states.get(n, 'not listed')} in etcd" for n in self.cluster.nodes
                        if n in alive and states.get(n) != "READY"})
            if set(bad) <= final or time.monotonic() > deadline:
                return [f"not serving again after {HEALTH_S:g}s: {', '.join(bad.values())}"] if bad else []
            await asyncio.sleep(POLL_S)

    async def check_probe(self) -> list[str]:
        async with grpc.aio.insecure_channel(self.cluster.router_address) as channel:
            outcome = await send(inference_pb2_grpc.InferenceStub(channel), self.probe, self.book)
        if outcome.code != OK:
            return [f"probe request failed: {outcome.code} {outcome.details}"]
        problem = token_violation(outcome, self.book.references[self.probe.prompt])
        return [problem] if problem else []

    async def check_no_leak(self) -> list[str]:
        """Blocks in use back to the baseline and no live sequence left, polled up to ``SETTLE_S``;
        each node's own count of used blocks equal to block_service's (one look when a child is dead)."""
        start = time.monotonic()
        deadline = start + (SETTLE_S if self._all_alive() else 0)
        while True:
            try:
                bad = await self._leaks()
            except grpc.aio.AioRpcError as e:
                bad = [f"block_service or a node did not answer Stats: {e.code().name} {e.details()}"]
            if not bad:
                return []
            if time.monotonic() > deadline:
                held = await asyncio.to_thread(self._live_sequences)
                return [f"leak: {'; '.join(bad)}, {time.monotonic() - start:.0f}s after the requests ended"
                        + (f"; live in block_service: {held}" if held else "")]
            await asyncio.sleep(POLL_S)

    async def blocks_in_use(self) -> tuple[int, int]:
        """(used blocks beyond the baseline, live sequences) in block_service, all nodes together."""
        nodes, _ = await self._block_stats()
        return (sum(max(n.num_used - self.base.used.get(n.node_id, 0), 0) for n in nodes),
                sum(n.num_sequences for n in nodes))

    async def _leaks(self) -> list[str]:
        nodes, _ = await self._block_stats()
        by_id = {n.node_id: n for n in nodes}
        bad = [f"block_service does not know {n}'s pool" for n in self.cluster.nodes if n not in by_id]
        for n in nodes:
            if n.num_sequences or n.num_used > self.base.used.get(n.node_id, 0):
                bad.append(f"{n.node_id}: {n.num_sequences} live sequences, {n.num_used} blocks used "
                           f"(baseline {self.base.used.get(n.node_id, 0)})")
        for name, child in self.cluster.nodes.items():
            if not child.alive() or name not in by_id:
                continue
            async with rpc.channel(f"127.0.0.1:{child.port}", peer=Identity.node(name)) as channel:
                stats = await compute_pb2_grpc.ComputeStub(channel).Stats(compute_pb2.ComputeStatsRequest(), timeout=5)
            if stats.num_running or stats.num_waiting:
                bad.append(f"{name} still runs {stats.num_running} and queues {stats.num_waiting} requests")
            if stats.num_used_blocks != by_id[name].num_used:
                bad.append(f"{name} counts {stats.num_used_blocks} used blocks, block_service {by_id[name].num_used}")
        return bad

    def _state_copy(self) -> tuple[str, object]:
        """The recovered page table of a copy of the state directory (block_service may be writing
        or rotating files meanwhile: copy, then replay the copy)."""
        state = self.cluster.work_dir / "block_state"
        for _ in range(5):
            with tempfile.TemporaryDirectory(prefix="chaos-state-") as tmp:
                try:
                    shutil.copytree(state, tmp, dirs_exist_ok=True)
                except (FileNotFoundError, shutil.Error):
                    continue  # a file rotated away mid-copy
                return recover(tmp)
        raise RuntimeError(f"could not copy {state}")

    def _live_sequences(self) -> str:
        table, _ = self._state_copy()
        seqs = table.to_dict()["sequences"]
        return ", ".join(f"{seq_id} ({tenant}, {num_tokens} tokens, {num_committed} committed)"
                         for seq_id, _node, tenant, _blocks, num_tokens, num_committed in seqs[:8]) \
            + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")

    async def check_durability(self) -> list[str]:
        try:
            for _ in range(5):  # at rest nothing writes; a late bookkeeping call may: read again
                before = (await self._block_stats())[1]
                table, replay = await asyncio.to_thread(self._state_copy)
                live = (await self._block_stats())[1]
                if before == live:
                    break
        except grpc.aio.AioRpcError as e:
            return [f"block_service did not answer Stats: {e.code().name} {e.details()}"]
        problems = []
        try:
            table.check()
        except AssertionError as e:
            problems.append(f"block_service's invariants broken in its durable state: {e}")
        if replay.stop_reason:
            problems.append(f"the state directory does not replay cleanly: {replay.summary()}")
        if replay.lsn < self.base.log_records:
            problems.append(f"acknowledged records lost: replay reaches record {replay.lsn}, "
                            f"block_service had acknowledged {self.base.log_records} before the fault")
        if replay.lsn != live:
            problems.append(f"the state directory replays to record {replay.lsn}, block_service reports {live}")
        return problems


async def _health(address: str, service: str, peer: Identity | None) -> str:
    async with rpc.channel(address, peer=peer) as channel:  # this process is the cluster's admin
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def last_errors(log: str, count: int = 4) -> str:
    """The log's last lines that say what went wrong: ERROR lines and each traceback's last line
    (the exception)."""
    found, in_traceback = [], False
    for line in log.splitlines():
        if line.startswith("Traceback"):
            in_traceback = True
        elif in_traceback and line[:1] not in (" ", "\t", ""):
            found.append(line)
            in_traceback = False
        elif " ERROR " in line or " CRITICAL " in line:
            found.append(line)
    return "\n".join(found[-count:]) or "(no error in its log)"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def report(problems: list[str]) -> str:
    return "the contract is broken:\n" + "\n".join(f"- {p}" for p in problems)
