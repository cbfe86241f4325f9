"""block_service as a real process: drive it over gRPC, SIGKILL it, restart it on the same state
directory, and find every acknowledged change; SIGTERM snapshots and exits 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.trace import Trace, drive, drive_async
from kvfleet.cli.ports import free_port
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.tenants import parse_tenants

ROOT = Path(__file__).resolve().parents[2]
TENANTS_YAML = """\
tenants:
  - {name: a, api_key: key-a, quota_mib: 4, paid_level: 1, max_concurrent: 8}
  - {name: b, api_key: key-b, quota_mib: 8, reserved_mib: 1, paid_level: 0, max_concurrent: 4}
"""



class Service:
    """Starts ``kvfleet block-service`` and always kills it."""

    def __init__(self, state_dir: Path, tenants: Path) -> None:
        self.state_dir, self.tenants = state_dir, tenants
        self.address = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = open(self.state_dir.parent / "service.log", "ab")
        # plaintext: these tests are about the page table's durability (test_replicas runs mutual TLS)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.cli.cli", "block-service", "--listen", self.address,
             "--state-dir", str(self.state_dir), "--tenants", str(self.tenants), "--insecure-internal"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def stop(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=20)
        self.proc = None
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    svc = Service(tmp_path / "state", tenants)
    try:
        yield svc
    finally:
        svc.kill()


async def _client(svc: Service) -> BlockManagerClient:
    client = BlockManagerClient(svc.address, timeout_s=10)
    await client.wait_ready(timeout_s=30)
    return client


def _pool_figures(stats) -> tuple:
    return (stats.node_id, stats.num_free, stats.num_cached, stats.num_used, stats.num_sequences,
            stats.tokens_stored, stats.token_capacity)


async def _assert_same_state(client: BlockManagerClient, mirror: PageTable, live: list[str],
                             extra: dict[str, list[int]]) -> None:
    nodes, _ = await client.stats()
    extra_blocks = sum(len(b) for b in extra.values())
    assert sum(n.num_used for n in nodes) == sum(mirror.node_stats(n).num_used for n in mirror.node_ids()) + extra_blocks
    assert [_pool_figures(n) for n in nodes if n.node_id == "n0"] == [_pool_figures(mirror.node_stats("n0"))]
    got = {s.seq_id: s.block_ids for s in await client.sequences(live + list(extra))}
    assert got == {**{s: mirror.sequence(s).block_ids for s in live}, **extra}


@pytest.mark.chaos
def test_sigkill_loses_no_acknowledged_change(service: Service) -> None:
    mirror = PageTable()  # the same calls in-process: what the service must hold
    mirror.configure_tenants(parse_tenants(yaml.safe_load(TENANTS_YAML)))
    trace, mirror_trace = (Trace(seed=11, node_ids=["n0", "n1"], tenants=["a", "b"]) for _ in range(2))

    async def first_life() -> dict[str, list[int]]:
        client = await _client(service)
        try:
            for node in ("n0", "n1"):
                await client.register_node(node, 400, 16, 1 << 16)
                mirror.register_node(node, 400, 16, 1 << 16)
            for _ in range(15):
                await drive_async(client, trace.step())
                drive(mirror, mirror_trace.step())
            # concurrent calls share fsyncs; each is acknowledged only once durable
            await client.register_node("n2", 64, 16, 1 << 16)
            results = await asyncio.gather(*(
                client.allocate_many([AllocateRequest("n2", f"c{i}", "c", [], 40)]) for i in range(16)
            ))
            acknowledged = {f"c{i}": r[0].block_ids for i, r in enumerate(results) if isinstance(r[0], Allocation)}
            assert len(acknowledged) == 16
            return acknowledged
        finally:
            await client.close()

    service.start()
    acknowledged = asyncio.run(first_life())
    service.proc.send_signal(signal.SIGKILL)
    service.proc.wait(timeout=10)

    async def second_life() -> None:
        client = await _client(service)
        try:
            await _assert_same_state(client, mirror, list(mirror_trace.live), acknowledged)
            # and it carries on from there: the same trace continues identically
            await client.release(list(acknowledged))
            for _ in range(3):
                await drive_async(client, trace.step())
        finally:
            await client.close()

    service.start()
    asyncio.run(second_life())
    assert service.stop(signal.SIGTERM) == 0
    snaps = sorted(p.name for p in service.state_dir.glob("*.snap"))
    logs = [p.stat().st_size for p in sorted(service.state_dir.glob("*.log"))]
    assert len(snaps) == 2 and logs[-1] == 16  # clean shutdown: snapshot, empty log (the older kept)
    out = subprocess.run([sys.executable, "-m", "kvfleet.cli.cli", "checkpoint", "verify", str(service.state_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all verify" in out.stdout


def test_refuses_to_start_from_a_stale_state_in_one_line(service: Service) -> None:
    """A corrupt newest snapshot whose records no log holds any more. The service
    must not start from the older snapshot (nodes and sequences long gone would come back)."""
    store, _ = DurablePageTable.open(str(service.state_dir), fsync=False)
    store.register_node("n0", 64, 16, 1 << 16)
    store.snapshot()
    store.allocate_many([AllocateRequest("n0", "s1", "a", [], 40)])
    newest = Path(store.snapshot())
    store.release(["s1"])
    store.sync()
    data = bytearray(newest.read_bytes())
    data[-10] ^= 1
    newest.write_bytes(data)
    for log in service.state_dir.glob("wal-*.log"):
        if log.name < "wal-" + newest.name.removeprefix("snapshot-"):
            log.unlink()
    service.start()
    assert service.proc.wait(timeout=60) == 2
    service.proc = None
    service.log.close()
    output = (service.state_dir.parent / "service.log").read_text()
    assert "Traceback" not in output
    [line] = [ln for ln in output.splitlines() if "cannot start" in ln]
    assert newest.name in line and "are missing" in line
