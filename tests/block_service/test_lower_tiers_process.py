"""Lower tiers end to end with ``kvfleet block-service`` as a real process: a node's remote
allocator sends its tier moves, the tenant's cap (from the tenants file) refuses one back, a SIGKILL
and restart recover the index from the log, ``kvfleet blocks`` shows it, and a sync re-sends the
node's whole index."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.compute_service.blocks.registration import RemoteAllocatorFactory
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TierChange
from kvfleet.core.block_hash import block_hashes
from tests.block_service.test_block_service_process import ROOT, Service

BPB = 1 << 16
TENANTS_YAML = """\
tenants:
  - {name: a, api_key: key-a, quota_mib: 4, lower_tier_quota_mib: 0.125, paid_level: 1, max_concurrent: 8}
"""  # a's lower-tier cap: 2 blocks of 64 KiB


@pytest.mark.process
@pytest.mark.chaos
def test_tier_moves_survive_a_sigkill_and_show_in_kvfleet_blocks(tmp_path: Path) -> None:
    (tmp_path / "tenants.yaml").write_text(TENANTS_YAML)
    service = Service(tmp_path / "state", tmp_path / "tenants.yaml")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def connect() -> BlockManagerClient:
        client = BlockManagerClient(service.address, timeout_s=10)
        await client.wait_ready(timeout_s=30)
        return client

    hs = block_hashes(list(range(80)), 16, b"a")
    moves = [TierChange(hs[0], "a", TIER_HOST), TierChange(hs[1], "a", TIER_DISK), TierChange(hs[2], "a", TIER_HOST)]
    try:
        service.start()
        factory = RemoteAllocatorFactory(on_loop(connect()), "n0", loop)
        allocator = factory(32, 16, BPB)  # registers the pool (off the loop, as the engine calls it)
        allocator.record_tiers(moves)
        allocator.end_step()
        on_loop(allocator.settle())
        assert allocator.take_tier_refusals() == [hs[2]]  # past a's cap of 2 blocks

        service.proc.send_signal(signal.SIGKILL)
        service.proc.wait(timeout=10)
        service.log.close()
        service.start()
        client = on_loop(connect())
        assert on_loop(client.match_tiers(hs)) == ({"n0": 0}, {"n0": 2})
        out = subprocess.run([sys.executable, "-m", "kvfleet.cli.cli", "blocks", "--block-service", service.address,
                              "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["nodes"][0]["lower_tier"] == {"host": 1, "disk": 1}
        [a] = [t for t in report["tenants"] if t["tenant"] == "a"]
        assert (a["lower_tier"], a["lower_tier_quota"]) == (2, 2)

        allocator.set_tier_source(lambda: [TierChange(hs[3], "a", TIER_DISK)])  # the node's own account
        on_loop(allocator.sync(periodic=True))
        assert on_loop(client.match_tiers(hs[3:5])) == ({"n0": 0}, {"n0": 1})
        on_loop(client.close())
        on_loop(factory.close())  # deregisters: the tiers go with the pool
        assert service.stop(signal.SIGTERM) == 0
    finally:
        service.kill()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
