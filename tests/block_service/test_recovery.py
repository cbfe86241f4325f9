"""Crash recovery: a log cut at any byte, or with any byte flipped, restores exactly the state after
the last intact record, and ``verify`` points at the first bad record."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from kvfleet.block_service.checkpoint import main as checkpoint_main
from kvfleet.block_service.checkpoint import verify
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.trace import Trace, drive
from kvfleet.block_service.wal import HEADER, scan_log
from kvfleet.core.tenants import Tenant


class _Recorder:
    """Forwards calls to the durable store and keeps the state after every log record."""

    def __init__(self, store: DurablePageTable) -> None:
        self.store = store
        self.states = {store.lsn: store.table.to_dict()}

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def call(*args):
            result = method(*args)
            self.states[self.store.lsn] = self.store.table.to_dict()
            return result

        return call


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict], list[int], int]:
    """A state dir left by a 'crash' (no close), the state after each record, record offsets."""
    state_dir = tmp_path_factory.mktemp("state")
    store, _ = DurablePageTable.open(str(state_dir), fsync=False)
    rec = _Recorder(store)
    rec.configure_tenants([Tenant("a", quota_mib=1)])
    for node in ("n0", "n1"):
        rec.register_node(node, 48, 16, 1 << 16)
    trace = Trace(seed=3, node_ids=["n0", "n1"], tenants=["a", "b"], prefix_blocks=2,
                  private_tokens=(1, 40), output_tokens=(16, 64), arrivals_per_step=3)
    for i in range(40):
        drive(rec, trace.step())
        if i == 20:
            for seq_id in rec.deregister_node("n1"):
                trace.live.pop(seq_id)
            rec.register_node("n1", 32, 16, 1 << 17)
    store.sync()
    log_path = str(state_dir / "wal-00000000000000000000.log")
    scan, records = scan_log(log_path)
    offsets = [offset for offset, _ in records] + [scan.end_offset]
    assert scan.error is None and len(offsets) - 1 == store.lsn > 100
    return state_dir, rec.states, offsets, os.path.getsize(log_path)


def _damaged_copy(state_dir: Path, dest: Path, damage) -> str:
    shutil.copytree(state_dir, dest)
    log_path = str(dest / "wal-00000000000000000000.log")
    data = bytearray(Path(log_path).read_bytes())
    Path(log_path).write_bytes(damage(data))
    return str(dest)


def test_cut_at_random_offsets(crashed, tmp_path: Path) -> None:
    state_dir, states, offsets, size = crashed
    rng = random.Random(0)
    cuts = [0, HEADER.size, size, size - 1] + [offsets[5] + 3] + [rng.randrange(size) for _ in range(25)]
    for i, cut in enumerate(cuts):
        d = _damaged_copy(state_dir, tmp_path / f"cut{i}", lambda data: data[:cut])
        table, report = recover(d)
        intact = sum(1 for end in offsets[1:] if end <= cut)
        assert report.records_applied == intact, (cut, report.summary())
        assert table.to_dict() == states[intact]
        table.check()
        torn = cut not in offsets
        assert (report.stop_reason is not None) == torn, (cut, report.summary())
        if torn:
            assert report.stop_offset == (offsets[intact] if cut >= HEADER.size else 0)
            assert verify(d).first_bad.bad_offset == report.stop_offset


def test_flipped_bytes(crashed, tmp_path: Path) -> None:
    state_dir, states, offsets, size = crashed
    rng = random.Random(1)
    for i in range(30):
        pos = rng.randrange(HEADER.size, size)
        bit = 1 << rng.randrange(8)

        def flip(data: bytearray) -> bytearray:
            data[pos] ^= bit
            return data

        d = _damaged_copy(state_dir, tmp_path / f"flip{i}", flip)
        table, report = recover(d)
        intact = sum(1 for end in offsets[1:] if end <= pos)
        assert report.records_applied == intact and report.stop_offset == offsets[intact], report.summary()
        assert table.to_dict() == states[intact]
        bad = verify(d).first_bad
        assert bad is not None and bad.bad_offset == offsets[intact]


def test_reopen_after_damage_keeps_bad_log_and_continues(crashed, tmp_path: Path, capsys) -> None:
    state_dir, states, offsets, size = crashed
    d = _damaged_copy(state_dir, tmp_path / "reopen", lambda data: data[: offsets[50] + 5])
    assert checkpoint_main(["--verify", d]) == 1
    assert f"offset {offsets[50]}" in capsys.readouterr().out
    store, report = DurablePageTable.open(d, fsync=False)
    assert report.records_applied == 50 and store.table.to_dict() == states[50]
    assert os.path.exists(os.path.join(d, "wal-00000000000000000000.log.bad"))
    store.register_node("n9", 16, 16, 1024)
    store.sync()  # crash again without close: the new log carries on from the snapshot
    table, report = recover(d)
    assert report.records_applied == 1 and "n9" in table.node_ids()
    assert checkpoint_main(["--verify", d]) == 0
