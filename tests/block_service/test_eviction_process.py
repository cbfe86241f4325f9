"""``kvfleet block-service --eviction-policy fair`` as a real process: the tenants file's
``cache_share_mib`` reaches the policy, a flood by a tenant without a share evicts its own blocks
(counted per tenant and reason over ``BlockStats``), and the state directory keeps its policy: a
restart under another one is refused in one line, a restart under the same one recovers."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.cli.ports import free_port
from kvfleet.core.allocator import AllocateRequest, Allocation
from tests.cli.test_first_contact import refused

pytestmark = pytest.mark.process  # starts block_service without a tier fixture (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TENANTS_YAML = """\
tenants:
  - {name: a, api_key: key-a, quota_mib: 8, cache_share_mib: 1, paid_level: 1, max_concurrent: 8}
  - {name: b, api_key: key-b, quota_mib: 8, paid_level: 0, max_concurrent: 4}
"""
BS, BPB = 16, 1 << 18  # four blocks per MiB: a's share is 4 blocks


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


async def requests(address: str) -> tuple[int, dict[str, dict[str, int]]]:
    """a caches a 4-block prompt, b floods 8 unique ones into a 16-block pool; returns a's cached
    run afterwards and the evictions per tenant."""
    client = BlockManagerClient(address, timeout_s=10)
    await client.wait_ready(timeout_s=60)
    try:
        await client.register_node("n0", 16, BS, BPB)
        for k, (tenant, hashes) in enumerate([("a", chain("a", 4))] * 2 + [("b", chain(f"b{j}", 4)) for j in range(8)]):
            [got] = await client.allocate_many([AllocateRequest("n0", f"s{k}", tenant, hashes, 4 * BS)])
            assert isinstance(got, Allocation), got
            await client.commit([(f"s{k}", i, h) for i, h in enumerate(hashes)])
            await client.release([f"s{k}"])
        run = (await client.match_prefix(chain("a", 4)))["n0"]
        _, tenants = await client.stats(["n0"])
        return run, {t.tenant: t.counters.evictions for t in tenants}
    finally:
        await client.close()


def test_fair_from_the_command_line_and_its_state_directory_keeps_it(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    state = tmp_path / "state"
    address = f"127.0.0.1:{free_port()}"
    base = ["block-service", "--listen", address, "--state-dir", str(state), "--tenants", str(tenants),
            "--insecure-internal", "--durability", "write"]

    def start(policy: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "kvfleet.cli.cli", *base, "--eviction-policy", policy],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    proc = start("fair")
    try:
        run, evictions = asyncio.run(requests(address))
        assert run == 4, "a's prompt, within its share, was evicted by b's flood"
        assert evictions["b"] == {"over_share": 20} and evictions["a"] == {}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        line = refused(*base, "--eviction-policy", "lru", tmp_path=tmp_path, code=2)
        assert "written under the eviction policy 'fair'" in line and "configured with 'lru'" in line
        proc = start("fair")
        client_run = asyncio.run(_cached_run(address))
        assert client_run == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def _cached_run(address: str) -> int:
    async with BlockManagerClient(address, timeout_s=10) as client:
        await client.wait_ready(timeout_s=60)
        return (await client.match_prefix(chain("a", 4)))["n0"]
