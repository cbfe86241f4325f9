"""The partition bed's clients, in the root namespace, each recording what it saw with times
(``checker``'s ``Write``, ``Stream``, ``QuotaSample``):

- ``PageTableClient``: a node of its own (``probe``) that sends every allocation and release to *both*
  block_service replicas, as a node that does not know which one leads would; whichever acknowledges
  is the one accepting writes, and an acknowledgement from both at once is a split brain;
- ``StreamClients``: threads streaming greedy Generate calls through the router, prompt after prompt;
- ``QuotaSampler``: every tenant's charge on every node against its quota, from the leader.

Each runs in a thread of its own (``start()`` / ``stop()``) so that a scenario injects faults from the
main thread while they run.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence

import grpc

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.cli.partition.bed_cluster import PROBE_NODE, REPLICAS, BedCluster
from kvfleet.cli.partition.checker import QuotaSample, Stream, Write
from kvfleet.core import rpc
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.errors import NotFound
from kvfleet.core.identity import Identity
from kvfleet.core.keepalive import MIN_PING_INTERVAL_MS, KeepalivePolicy
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

CALL_TIMEOUT_S = 1.5
CLEANUP_EVERY = 10  # rounds between releases of allocations that may have been applied unacknowledged
STREAM_KEEPALIVE = KeepalivePolicy(ping_interval_ms=MIN_PING_INTERVAL_MS, ping_timeout_ms=3_000)
PROBE_BLOCKS = 4096
PROBE_BLOCK_BYTES = 1 << 12  # BED_TENANTS' tight quota counts in these


class _Loop(threading.Thread):
    """A thread running ``self.body()`` (a coroutine or a function) until ``stop()``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)


def maybe_held(op: str, ok: bool, error: str) -> bool:
    """A write whose allocation a replica may hold though it was not acknowledged: the call timed
    out or broke, or the leader applied it and then could not write the durable mark. Not a
    refusal (an answer: nothing held) nor a replica that is not the leader (it applies nothing)."""
    return op == "alloc" and not ok and error not in ("Refusal", "NotLeader")


def release_unsettled(answers: Sequence[tuple[bool, str]]) -> bool:
    """A release (``(ok, error)`` from each replica) that no replica answered done or ``NotFound``:
    the sequence may still be held (the release timed out or broke), so it is released again later."""
    return not any(ok or error == "NotFound" for ok, error in answers)


class PageTableClient(_Loop):
    def __init__(self, cluster: BedCluster, prefix: str = "p", tenant: str = "tight", interval_s: float = 0.05,
                 seed: int = 1) -> None:
        super().__init__()
        self.cluster, self.prefix, self.tenant, self.interval_s = cluster, prefix, tenant, interval_s
        self.rng = random.Random(seed)
        self.writes: list[Write] = []
        self.acked: list[str] = []  # live sequences as acknowledged (candidates for a release)
        # allocations perhaps held unacknowledged (or whose release went unanswered), released every
        # CLEANUP_EVERY rounds as a node's
        # resync would (not recorded: never acknowledged, no check reads them); kept, they filled
        # the tenant's quota in the 300 s lossy soak and every allocation after ~150 s was refused
        self.unsure: list[str] = []
        self.refusals = 0

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by the scenario
            self.error = e

    async def _main(self) -> None:
        credentials = self.cluster.credentials(Identity.node(PROBE_NODE))
        clients = {r: BlockManagerClient(self.cluster.address(r), timeout_s=CALL_TIMEOUT_S, credentials=credentials)
                   for r in REPLICAS}
        try:
            await self._register(clients)
            i = 0
            while not self.stopping.is_set():
                if self.acked and self.rng.random() < 0.4:
                    await self._round(clients, "release", self.acked.pop(self.rng.randrange(len(self.acked))))
                else:
                    await self._round(clients, "alloc", f"{self.prefix}{i}")
                    i += 1
                if self.unsure and i % CLEANUP_EVERY == 0:
                    await self._release_unsure(clients)
                await asyncio.sleep(self.interval_s)
        finally:
            for c in clients.values():
                await c.close()

    async def _register(self, clients: dict[str, BlockManagerClient]) -> None:
        deadline = time.monotonic() + 60
        while True:
            for client in clients.values():
                try:
                    await client.register_node(PROBE_NODE, PROBE_BLOCKS, 16, PROBE_BLOCK_BYTES)
                    return
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError("no replica registered the probe node within 60 s")
            await asyncio.sleep(0.2)

    async def _round(self, clients: dict[str, BlockManagerClient], op: str, seq_id: str) -> None:
        """One call to each replica at once; the sequence id names the replica it went to, so that a
        split brain shows as two live sequences, never as one sequence granted twice."""
        start = time.monotonic()
        results = await asyncio.gather(*(self._call(c, op, seq_id if op == "release" else f"{seq_id}{r[-2:]}")
                                         for r, c in clients.items()))
        for replica, (ok, sent_id, blocks, end, error) in zip(clients, results):
            self.writes.append(Write(start, end, replica, op, sent_id, ok, blocks, error))
            if ok and op == "alloc":
                self.acked.append(sent_id)
            elif maybe_held(op, ok, error):
                self.unsure.append(sent_id)
        if op == "release" and release_unsettled([(ok, error) for ok, _, _, _, error in results]):
            self.unsure.append(seq_id)

    async def _release_unsure(self, clients: dict[str, BlockManagerClient]) -> None:
        """Release the unsure allocations (a few at a time) on every replica; each is forgotten once
        a replica answered its release (done, or ``NotFound``: never applied)."""
        batch = self.unsure[:8]
        answered = await asyncio.gather(*(self._forget(clients, seq_id) for seq_id in batch))
        gone = {seq_id for seq_id, done in zip(batch, answered) if done}
        self.unsure = [s for s in self.unsure if s not in gone]

    async def _forget(self, clients: dict[str, BlockManagerClient], seq_id: str) -> bool:
        results = await asyncio.gather(*(c.release([seq_id], tenant=self.tenant) for c in clients.values()),
                                       return_exceptions=True)
        return any(r is None or isinstance(r, NotFound) for r in results)

    async def _call(self, client: BlockManagerClient, op: str, seq_id: str):
        try:
            if op == "release":
                await client.release([seq_id], tenant=self.tenant)
                return True, seq_id, (), time.monotonic(), ""
            [got] = await client.allocate_many([AllocateRequest(PROBE_NODE, seq_id, self.tenant, [], 16)])
            ok = isinstance(got, Allocation)
            self.refusals += not ok  # the pool or the tenant's quota said no (an answer, not an outage)
            return ok, seq_id, tuple(got.block_ids) if ok else (), time.monotonic(), "" if ok else "Refusal"
        except Exception as e:
            error = "NotLeader" if "is not the leader" in str(e) else type(e).__name__
            return False, seq_id, (), time.monotonic(), error

    def final_state(self, timeout_s: float = 60.0) -> dict[str, list[int]]:
        """Seq id → block ids of every sequence this client allocated, as the leader holds them now."""
        seq_ids = sorted({w.seq_id for w in self.writes if w.op == "alloc"})

        async def one(client: BlockManagerClient, seq_id: str) -> tuple[str, list[int] | None]:
            try:
                [state] = await client.sequences([seq_id])
            except NotFound:
                return seq_id, None
            return seq_id, list(state.block_ids)

        async def read(leader: str) -> dict[str, list[int]]:
            async with BlockManagerClient(self.cluster.address(leader), timeout_s=10,
                                          credentials=self.cluster.admin()) as client:
                held = {}
                for i in range(0, len(seq_ids), 50):
                    got = await asyncio.gather(*(one(client, s) for s in seq_ids[i:i + 50]))
                    held.update({s: blocks for s, blocks in got if blocks is not None})
                return held

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return asyncio.run(read(self.cluster.wait_leader(timeout=timeout_s)))
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


    def release_all(self, seq_ids: Sequence[str]) -> None:
        """Release ``seq_ids`` on the leader (a scenario's leftovers: the next one starts with its
        tenant's quota free); best effort, after the history is taken."""
        if not seq_ids:
            return

        async def release(leader: str) -> None:
            async with BlockManagerClient(self.cluster.address(leader), timeout_s=10,
                                          credentials=self.cluster.credentials(Identity.node(PROBE_NODE))) as client:
                await client.release(list(seq_ids), tenant=self.tenant)

        try:
            asyncio.run(release(self.cluster.wait_leader(timeout=30)))
        except Exception:  # noqa: S110 - the next scenario still runs; its refusals show a full quota
            pass


def generate(address: str, prompt: Sequence[int], max_tokens: int, stream: Stream, api_key: str = "sk-gold",
             timeout_s: float = 60.0) -> Stream:
    """One greedy Generate through the router into ``stream`` (its tokens, its error)."""
    req = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req.tokens.ids.extend(prompt)
    try:
        # pinging every second: a call on a connection whose reset was lost (the lossy soak)
        # otherwise waited for its whole timeout, and with the services' 20 s pings the delay
        # proxy's onset (it resets the router's end of every open connection; this end, which only
        # receives, is never told) left the streams under way blind for 20 s: the cluster's outage
        with grpc.insecure_channel(address, options=rpc.channel_options(keepalive=STREAM_KEEPALIVE)) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                req, metadata=[("authorization", f"Bearer {api_key}")], timeout=timeout_s)
            for chunk in call:
                stream.tokens.extend(chunk.token_ids)
                if chunk.token_ids:
                    stream.times.append(time.monotonic())
    except grpc.RpcError as e:
        stream.error = f"{e.code().name}: {e.details()}"
    stream.t_end = time.monotonic()
    return stream


class StreamClients:
    """``n`` threads, each streaming the prompts in turn until ``stop()``; ``streams`` holds them all."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int, n: int = 2) -> None:
        self.address, self.prompts, self.max_tokens = address, prompts, max_tokens
        self.streams: list[Stream] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(n)]

    def reference(self) -> dict[int, list[int]]:
        """Every prompt once, before any fault: the fault-free float32 run the checker compares with."""
        ref = {}
        for i, prompt in enumerate(self.prompts):
            got = generate(self.address, prompt, self.max_tokens, Stream(time.monotonic(), 0.0, i), timeout_s=120)
            if got.error:
                raise RuntimeError(f"the fault-free run failed: {got.error}")
            ref[i] = got.tokens
        return ref

    def _run(self, k: int) -> None:
        i = k
        while not self.stopping.is_set():
            stream = Stream(time.monotonic(), 0.0, i % len(self.prompts))
            self.streams.append(generate(self.address, self.prompts[stream.prompt], self.max_tokens, stream))
            if stream.error:
                time.sleep(0.2)
            i += 1

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(90)


class QuotaSampler(_Loop):
    def __init__(self, cluster: BedCluster, interval_s: float = 0.5) -> None:
        super().__init__()
        self.cluster, self.interval_s = cluster, interval_s
        self.samples: list[QuotaSample] = []

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        clients = {r: BlockManagerClient(self.cluster.address(r), timeout_s=CALL_TIMEOUT_S,
                                         credentials=self.cluster.admin()) for r in REPLICAS}
        try:
            while not self.stopping.is_set():
                for client in clients.values():  # both: a deposed leader's view counts too
                    try:
                        _, tenants = await client.stats()
                    except Exception:
                        continue
                    now = time.monotonic()
                    self.samples += [QuotaSample(now, t.tenant, t.node_id, t.blocks_charged, t.blocks_allowed)
                                     for t in tenants]
                await asyncio.sleep(self.interval_s)
        finally:
            for c in clients.values():
                await c.close()
