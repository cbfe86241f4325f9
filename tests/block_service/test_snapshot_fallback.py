"""A corrupt newest snapshot: block_service recovers to the last good record from
the older snapshot and the logs after it, or refuses to start saying which file is corrupt and which
records are missing — never silently from a stale state. Real files, real damage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet.block_service.checkpoint import main as checkpoint_main
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import RecoveryError, recover
from kvfleet.block_service.trace import Trace, drive


def _snapshots(d: Path) -> list[Path]:
    return sorted(d.glob("snapshot-*.snap"))


def _logs(d: Path) -> list[Path]:
    return sorted(d.glob("wal-*.log"))


def _history(state_dir: Path) -> dict:
    """Three lives of work with a snapshot between each; ends in a crash (no close). Returns the
    state after the last record."""
    store, _ = DurablePageTable.open(str(state_dir), fsync=False)
    store.register_node("n0", 64, 16, 1 << 16)
    trace = Trace(seed=7, node_ids=["n0"], tenants=["a", "b"])
    for _ in range(3):
        for _ in range(8):
            drive(store, trace.step())
        store.snapshot()
    for _ in range(4):
        drive(store, trace.step())
    store.sync()
    return store.table.to_dict()


def _corrupt_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(data)


def test_corrupt_newest_snapshot_falls_back_to_the_older_one_and_replays_its_logs(tmp_path: Path, capsys) -> None:
    expected = _history(tmp_path)
    older, newest = _snapshots(tmp_path)
    _corrupt_a_byte(newest)
    table, report = recover(str(tmp_path))
    assert table.to_dict() == expected
    assert report.snapshot_path == str(older) and report.corrupt_snapshots == [str(newest)]
    assert str(newest) in report.summary() and "CRC mismatch" in report.summary()
    assert checkpoint_main(["--verify", str(tmp_path)]) == 1  # a file is bad, but it says recovery works
    out = capsys.readouterr().out
    assert f"recovers: {report.summary()}" in out

    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    assert store.table.to_dict() == expected
    assert os.path.exists(str(newest) + ".bad")  # kept for inspection, never read again
    store.close()
    assert recover(str(tmp_path))[0].to_dict() == expected
    assert checkpoint_main(["--verify", str(tmp_path)]) == 0


def test_corrupt_newest_snapshot_without_its_logs_refuses_to_start(tmp_path: Path, capsys) -> None:
    _history(tmp_path)
    older, newest = _snapshots(tmp_path)
    _corrupt_a_byte(newest)
    lsn = lambda p: int(p.name.split("-")[1].split(".")[0])  # noqa: E731
    for log in _logs(tmp_path):
        if lsn(log) < lsn(newest):
            log.unlink()  # the old log segments are gone
    files = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RecoveryError) as err:
        DurablePageTable.open(str(tmp_path), fsync=False)
    message = str(err.value)
    assert "\n" not in message and str(newest) in message
    assert f"records {lsn(older)}..{lsn(newest) - 1} are missing" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # nothing written, nothing moved
    assert checkpoint_main(["--verify", str(tmp_path)]) == 1
    assert f"cannot recover: {message}" in capsys.readouterr().out


def test_a_missing_log_between_good_files_refuses_to_start(tmp_path: Path) -> None:
    _history(tmp_path)
    older, newest = _snapshots(tmp_path)
    first_log, later_log = _logs(tmp_path)
    newest.unlink()     # gone, not corrupt: nothing says it existed
    first_log.unlink()  # and the log after the older snapshot; a later log is still there
    with pytest.raises(RecoveryError, match=f"starts at record .* the state from {older.name}") as err:
        recover(str(tmp_path))
    assert "are missing" in str(err.value) and later_log.name in str(err.value)
