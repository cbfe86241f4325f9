"""Operating block_service as a real process: a pool filled on purpose logs
``block_pool exhausted`` at most once a second with the refusals it did not log counted, and
``kvfleet blocks`` shows what was allocated; the log shipped to a backup directory restores a lost
state directory to the last shipped record."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvfleet.block_service.backup import read_manifest
from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.node_pool import WARN_INTERVAL_S
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.trace import Trace, drive, drive_async
from kvfleet.cli.cluster_state import ClusterState
from kvfleet.cli.ports import free_port
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.tenants import parse_tenants

ROOT = Path(__file__).resolve().parents[2]
TENANTS = """\
tenants:
  - {name: a, api_key: key-a, quota_mib: 4, paid_level: 1, max_concurrent: 8}
  - {name: b, api_key: key-b, quota_mib: 1, paid_level: 0, max_concurrent: 4}
"""
EXHAUSTED = re.compile(r"block_pool exhausted \(alloc=(\d+)/(\d+)\) node=(\S+) tenant=(\S+) asked=(\d+) "
                       r".* suppressed=(\d+) top holders: (.*)$")


def _kvfleet(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfleet.cli.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=None if env is None else {**os.environ, **env})


@contextlib.contextmanager
def block_service(tmp: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """A ``kvfleet block-service`` process on a free port, in plaintext (what is tested is the log and
    ``kvfleet blocks``, not who may call); always killed."""
    (tmp / "tenants.yaml").write_text(TENANTS)
    address = f"127.0.0.1:{free_port()}"
    log = tmp / "service.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.cli.cli", "block-service", "--listen", address, "--state-dir",
             str(tmp / "state"), "--tenants", str(tmp / "tenants.yaml"), "--insecure-internal", *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield address, proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def _ready(address: str) -> BlockManagerClient:
    client = BlockManagerClient(address, timeout_s=10)
    await client.wait_ready(timeout_s=30)
    return client


@pytest.mark.process
def test_an_exhausted_pool_is_logged_once_a_second_and_kvfleet_blocks_names_its_holders(tmp_path: Path) -> None:
    with block_service(tmp_path) as (address, proc, log):
        async def fill_and_burst() -> int:
            client = await _ready(address)
            try:
                await client.register_node("n0", 16, 16, 1 << 16)
                filled = await client.allocate_many([
                    AllocateRequest("n0", "a-1", "a", [], 40),    # 3 blocks, 8 slots unused
                    AllocateRequest("n0", "a-2", "a", [], 100),   # 7 blocks, 12 unused
                    AllocateRequest("n0", "b-1", "b", [], 96),    # 6 blocks, full
                ])
                assert all(isinstance(r, Allocation) for r in filled)
                refused = 0
                for i in range(40):  # a burst: 200 refusals, far faster than one a second
                    results = await client.allocate_many(
                        [AllocateRequest("n0", f"x-{i}-{j}", "b", [], 16) for j in range(5)])
                    assert all(isinstance(r, Refusal) and r.reason == "pool" for r in results)
                    refused += len(results)
                await asyncio.sleep(WARN_INTERVAL_S * 1.1)  # one more after the interval: its line
                last = await client.allocate("n0", "x-last", "a", [], 16)  # counts the suppressed
                assert isinstance(last, Refusal)
                await client.commit([("a-1", 0, b"\x01" * 16), ("a-1", 1, b"\x02" * 16)])
                await client.release(["a-1"])  # 2 committed blocks cached, 1 free
                return refused + 1
            finally:
                await client.close()

        refusals = asyncio.run(fill_and_burst())
        table = _kvfleet("blocks", "--block-service", address, "--top", "2")
        as_json = _kvfleet("blocks", "--block-service", address, "--top", "2", "--json")
        unknown = _kvfleet("blocks", "--block-service", address, "--node", "nope")
        # without --block-service: the local cluster's, from the state file `kvfleet up` writes
        state = tmp_path / "cluster.json"
        ClusterState("127.0.0.1:1", os.getpid(), None, str(tmp_path), (address,)).write(state)
        implicit = _kvfleet("blocks", "--top", "2", env={"KVFLEET_STATE_FILE": str(state)})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0

    lines = [m for m in map(EXHAUSTED.search, log.read_text().splitlines()) if m]
    assert 2 <= len(lines) < refusals  # throttled: once per interval, not once per refusal
    alloc, total, node, tenant, asked, _, holders = lines[0].groups()
    assert (alloc, total, node, tenant, asked) == ("16", "16", "n0", "b", "1")
    assert holders == "tenant=a sequences=2 blocks=10, tenant=b sequences=1 blocks=6"
    assert sum(int(m.group(6)) for m in lines) + len(lines) == refusals  # every refusal counted

    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert re.search(r"^node n0: 16 blocks of 16 tokens, 2 sequences, refusals pool=201 quota=0$", out, re.M)
    assert re.search(r"^  device\s+13\s+2\s+1$", out, re.M)  # used / cached / free
    assert "waste: 12 token slots unused in partly filled last blocks" in out
    assert re.search(r"^    a-2\s+a\s+7\s+100\s+12\s+\d+s$", out, re.M)
    assert re.search(r"^    b-1\s+b\s+6\s+96\s+0\s+\d+s$", out, re.M)
    # charged vs quota, then the lower tiers' charge vs its cap (none held, unlimited), then evicted
    assert re.search(r"^  a\s+n0\s+7\s+64\s+0\s+1\s+1\s+0\s+0\s+unlimited\s+0\s+\d+$", out, re.M)
    assert re.search(r"^  b\s+n0\s+6\s+16\s+0\s+1\s+200\s+0\s+0\s+unlimited\s+0\s+\d+$", out, re.M)
    assert re.search(r"^  host\s+0\s+0\s+0$", out, re.M) and re.search(r"^  disk\s+0\s+0\s+0$", out, re.M)

    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout.splitlines()[-1])
    (n0,) = report["nodes"]
    assert (n0["used"], n0["cached"], n0["free"], n0["waste_tokens"]) == (13, 2, 1, 12)
    assert n0["tiers"] == [{"tier": "device", "num_used": 13, "num_cached": 2, "num_free": 1},
                           {"tier": "host", "num_used": 0, "num_cached": 0, "num_free": 0},
                           {"tier": "disk", "num_used": 0, "num_cached": 0, "num_free": 0}]
    assert [(h["seq_id"], h["tenant"], h["num_blocks"], h["tail_waste_tokens"], h["age_at_least"])
            for h in n0["top_holders"]] == [("a-2", "a", 7, 12, False), ("b-1", "b", 6, 0, False)]
    assert all(h["age_s"] >= 0 for h in n0["top_holders"])
    assert {t["tenant"]: (t["charged"], t["quota"]) for t in report["tenants"]} == {"a": (7, 64), "b": (6, 16)}

    assert unknown.returncode == 1
    assert unknown.stderr.strip() == f"kvfleet blocks: block_service at {address}: unknown node 'nope'"
    assert implicit.returncode == 0 and implicit.stdout.splitlines()[0] == table.stdout.splitlines()[0]  # ages move


def _wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.process
@pytest.mark.chaos
def test_a_lost_state_directory_is_restored_from_the_shipped_backup(tmp_path: Path) -> None:
    backup = tmp_path / "backup"
    mirror = PageTable()  # the same calls in-process: the state the backup must restore to
    mirror.configure_tenants(parse_tenants(yaml.safe_load(TENANTS)), replace_all=True)
    trace, mirror_trace = (Trace(seed=3, node_ids=["n0"], tenants=["a", "b"]) for _ in range(2))
    with block_service(tmp_path, "--backup-dir", str(backup), "--log-ship-interval", "0.2s",
                       "--snapshot-interval", "1s") as (address, proc, log):
        async def work(steps: int) -> int:
            client = await _ready(address)
            try:
                if mirror.register_node("n0", 128, 16, 1 << 16):
                    await client.register_node("n0", 128, 16, 1 << 16)
                for _ in range(steps):
                    await drive_async(client, trace.step())
                    drive(mirror, mirror_trace.step())
                return (await client.blocks(top_holders=0)).log_records
            finally:
                await client.close()

        def shipped() -> int:
            manifest = read_manifest(str(backup))
            return manifest.shipped_lsn if manifest else -1

        first = asyncio.run(work(20))
        # the schedule: a snapshot after this work reaches the backup as its new base
        _wait_until(lambda: (m := read_manifest(str(backup))) is not None and m.snapshot.start_lsn >= first,
                    "a snapshot shipped")
        acknowledged = asyncio.run(work(20))
        _wait_until(lambda: shipped() == acknowledged, f"record {acknowledged} shipped")
        proc.kill()  # the disaster: the process and its whole state directory
        proc.wait(timeout=10)
    shutil.rmtree(tmp_path / "state")

    verified = _kvfleet("checkpoint", "verify", "--crc32", str(backup))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    restored = _kvfleet("checkpoint", "restore", "--from", str(backup), "--state-dir", str(tmp_path / "state"))
    assert restored.returncode == 0, restored.stderr
    assert f"to record {acknowledged} of {acknowledged} shipped" in restored.stdout
    table, report = recover(str(tmp_path / "state"))
    assert report.lsn == acknowledged
    assert table.to_dict() == mirror.to_dict()  # nothing acknowledged before the last ship is lost

    again = _kvfleet("checkpoint", "restore", "--from", str(backup), "--state-dir", str(tmp_path / "state"))
    assert again.returncode == 1 and "is not empty" in again.stderr and len(again.stderr.splitlines()) == 1
