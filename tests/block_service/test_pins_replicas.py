"""Pins across two block_service replicas (real processes, a real etcd): the standby replays the
leader's pin and its expiry from the log (the leader ends an expired pin by writing a record), so
both list the same pins, hold the same blocks, and then free them alike."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from replicas import credentials, wait_leader

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.identity import Identity
from kvfleet.core.tls import Credentials
from tests.block_service.test_page_table_stateful import family_hash
from tests.block_service.test_replicas import admin, certs_dir, etcd, replicas  # noqa: F401 (fixtures)

TENANTS = """\
tenants:
  - {name: gold, api_key: sk-gold, quota_mib: 64, paid_level: 1, max_concurrent: 4, pinned_mib: 0.25}
"""


async def _pins_and_cache(address: str, reader: Credentials, hashes: list[bytes]) -> tuple:
    async with BlockManagerClient(address, timeout_s=10, credentials=reader) as client:
        await client.wait_ready(30)
        report = await client.blocks()
        held = await client.match_prefix(hashes)
    pins = sorted((p.tenant, p.node_id, p.pinned, p.allowed, p.cached, p.earliest) for p in report.pins)
    return report.log_records, pins, held, [n.stats.num_cached for n in report.nodes]


def test_the_standby_replays_pins_and_their_expiry(etcd, replicas, certs_dir, admin, tmp_path: Path) -> None:  # noqa: F811
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    a = replicas("a", "--sync-standby", "--tenants", str(tenants))
    wait_leader(etcd.url, a.address, [a])
    b = replicas("b", "--standby", "--tenants", str(tenants))
    hashes = [family_hash(0, i) for i in range(3)]

    async def same(timeout_s: float = 60.0) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            mine, theirs = await _pins_and_cache(a.address, admin, hashes), await _pins_and_cache(b.address, admin, hashes)
            if mine == theirs or time.monotonic() > deadline:
                assert theirs == mine
                return mine

    async def run() -> None:
        node = BlockManagerClient(a.address, timeout_s=10, credentials=credentials(certs_dir, Identity.node("n0")))
        async with node, BlockManagerClient(a.address, timeout_s=10, credentials=admin) as operator:
            await node.register_node("n0", 64, 16, 1 << 15)
            got = await node.allocate_many([AllocateRequest("n0", "s1", "gold", hashes, 48)])
            assert isinstance(got[0], Allocation)
            await node.commit([("s1", i, h) for i, h in enumerate(hashes)])
            await node.release(["s1"])
            # long enough to be read on both replicas on a loaded machine (2 s expired first under 3 test workers)
            pinned = await operator.pin_prefix("n0", "gold", hashes, ttl_s=10)
            assert (pinned.num_new, pinned.tenant_pinned, pinned.allowed) == (3, 3, 8)
        _, pins, held, _ = await same()
        assert [p[:5] for p in pins] == [("gold", "n0", 3, 8, 3)] and held == {"n0": 3}
        deadline = time.monotonic() + 45  # the pin's 10 s, and the leader's expiry loop looks every 5 s
        while (await _pins_and_cache(a.address, admin, hashes))[1] and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        _, pins, held, _ = await same()
        assert pins == [] and held == {"n0": 3}, "an expired pin ends its hold, not the cached blocks"

    asyncio.run(run())
