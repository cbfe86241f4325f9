"""Reloading the tenants of a real block_service process: nothing cached is lost (the blocks and
their hashes stay, by ``ConfigureTenants`` and by a restart that reads the file again); a reload
whose pin budget exceeds a node's pool is refused with one line naming it and changes nothing; a
node registering with a pool the tenants' reservations overfill is logged in one line."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.core.allocator import Allocation
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.tenants import Tenant
from tests.block_service.test_operations_process import _ready, block_service

BPB = 1 << 16               # 16 blocks per MiB
HASHES = [bytes([7, i]) * 8 for i in range(4)]


async def _cached(client: BlockManagerClient) -> tuple[int, int, int]:
    """(leading blocks of HASHES found on n0, its cached blocks, its used blocks)."""
    nodes, _ = await client.stats(["n0"])
    return (await client.match_prefix(HASHES, ["n0"]))["n0"], nodes[0].num_cached, nodes[0].num_used


async def _quota_of(client: BlockManagerClient, tenant: str) -> int | None:
    _, tenants = await client.stats(["n0"])
    return next(t.blocks_allowed for t in tenants if t.tenant == tenant)


@pytest.mark.process
def test_a_reload_keeps_every_cached_block_and_a_pin_budget_past_the_pool_is_refused(tmp_path: Path) -> None:
    async def fill_and_reload(address: str) -> None:
        client = await _ready(address)
        try:
            await client.register_node("n0", 16, 16, BPB)
            assert isinstance(await client.allocate("n0", "a-1", "a", HASHES, 64), Allocation)
            await client.commit([("a-1", i, h) for i, h in enumerate(HASHES)])
            await client.release(["a-1"])
            assert isinstance(await client.allocate("n0", "b-1", "b", [], 32), Allocation)  # 2 used
            assert await _cached(client) == (4, 4, 2)

            await client.configure_tenants([Tenant("a", quota_mib=2, cache_share_mib=0.5), Tenant("b", quota_mib=1)],
                                           replace_all=True)
            assert await _cached(client) == (4, 4, 2)
            assert await _quota_of(client, "a") == 32

            with pytest.raises(InvalidArgument) as refused:
                await client.configure_tenants([Tenant("a", quota_mib=4, pinned_mib=2)])
            assert str(refused.value) == ("tenants not configured: tenant 'a': pinned_mib 2 is 32 blocks, past node "
                                          "n0's pool of 16 blocks (1 MiB)")
            assert await _quota_of(client, "a") == 32  # nothing changed
            assert await _cached(client) == (4, 4, 2)

            await client.configure_tenants([Tenant("a", quota_mib=2, reserved_mib=0.25),
                                            Tenant("b", quota_mib=1, reserved_mib=0.25)], replace_all=True)
            await client.register_node("n1", 4, 16, BPB)  # 4 blocks; 8 reserved: one line in the log
            assert await _cached(client) == (4, 4, 2)
        finally:
            await client.close()

    async def after_restart(address: str) -> tuple[int, int, int]:
        client = await _ready(address)
        try:
            return await _cached(client)
        finally:
            await client.close()

    with block_service(tmp_path) as (address, proc, log):
        asyncio.run(fill_and_reload(address))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    lines = [line for line in log.read_text().splitlines() if "cannot honour" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "node n1 registered; its pool cannot honour the tenants file: tenants' reserved shares sum to 8 blocks, "
        "past node n1's pool of 4 blocks (0.25 MiB): a tenant without a reservation may be refused every block")

    with block_service(tmp_path) as (address, proc, log):  # the file is read again at start-up: a reload too
        assert asyncio.run(after_restart(address)) == (4, 4, 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
