"""Disaster recovery: the log shipped to a backup directory, the state directory
lost, a state restored from the backup equal to the state at the last shipped record; a corrupt
segment refused naming it (or, with --partial, restored up to its last good record). Real files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvfleet.block_service.backup import MANIFEST, BackupError, read_manifest, ship
from kvfleet.block_service.checkpoint import main as checkpoint_main
from kvfleet.block_service.checkpoint import verify
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.restore import restore
from kvfleet.block_service.trace import Trace, drive
from kvfleet.block_service.wal import FRAME, HEADER


class History:
    """A store driven by a trace, its state remembered at every step's end (by record)."""

    def __init__(self, state_dir: Path) -> None:
        self.store, _ = DurablePageTable.open(str(state_dir), fsync=False)
        self.store.register_node("n0", 64, 16, 1 << 16)
        self.trace = Trace(seed=5, node_ids=["n0"], tenants=["a", "b"])
        self.states = {self.store.lsn: self.store.table.to_dict()}

    def steps(self, n: int) -> None:
        for _ in range(n):
            drive(self.store, self.trace.step())
            self.states[self.store.lsn] = self.store.table.to_dict()
        self.store.sync()

    def ship(self, backup: Path):
        return ship(self.store.durable_lsn, str(self.store.state_dir), str(backup), fsync=False)


def _shipped_history(tmp_path: Path) -> tuple[History, Path, int, int]:
    """Ship, snapshot, ship twice more, then work that is never shipped; returns the history, the
    backup and the last two shipped records."""
    h, backup = History(tmp_path / "state"), tmp_path / "backup"
    h.steps(6)
    h.ship(backup)
    h.steps(6)
    h.store.snapshot()  # a newer full snapshot: the next ship replaces the backup's base
    h.steps(5)
    first = h.ship(backup)
    assert first.snapshot is not None and first.segment is not None
    h.steps(5)
    last = h.ship(backup)
    assert last.snapshot is None and last.first_lsn == first.shipped_lsn
    h.steps(4)  # acknowledged after the last ship: lost with the state directory
    assert h.store.lsn > last.shipped_lsn
    return h, backup, first.shipped_lsn, last.shipped_lsn


def test_restore_after_losing_the_state_directory_gives_the_last_shipped_state(tmp_path: Path) -> None:
    h, backup, _, shipped = _shipped_history(tmp_path)
    manifest = read_manifest(str(backup))
    assert manifest.shipped_lsn == shipped
    assert sorted(p.name for p in backup.iterdir()) == sorted([MANIFEST] + [f.name for f in manifest.files])
    assert [f.kind for f in manifest.files] == ["snapshot", "log", "log"]
    assert checkpoint_main(["--verify", str(backup)]) == 0

    shutil.rmtree(h.store.state_dir)  # the disaster
    state = tmp_path / "state"
    report = restore(str(backup), str(state), fsync=False)
    assert (report.lsn, report.shipped_lsn, report.bad_file) == (shipped, shipped, None)
    assert recover(str(state))[0].to_dict() == h.states[shipped]
    store, rec = DurablePageTable.open(str(state), fsync=False)  # block_service starts from it
    assert rec.lsn == shipped and store.table.to_dict() == h.states[shipped]


def _corrupt_first_record(segment: Path) -> None:
    data = bytearray(segment.read_bytes())
    data[HEADER.size + FRAME.size] ^= 0x40  # the first payload byte of the first record
    segment.write_bytes(data)


def test_a_corrupt_segment_is_refused_naming_it_or_restored_up_to_its_last_good_record(
        tmp_path: Path, capsys) -> None:
    h, backup, before_last, shipped = _shipped_history(tmp_path)
    segment = backup / read_manifest(str(backup)).files[-1].name
    _corrupt_first_record(segment)
    state = tmp_path / "restored"
    with pytest.raises(BackupError, match=f"{segment}: CRC32 .* the manifest says") as err:
        restore(str(backup), str(state), fsync=False)
    assert "\n" not in str(err.value) and not state.exists()
    assert checkpoint_main(["--verify", str(backup)]) == 1
    out = capsys.readouterr().out
    assert f"{segment}: 0 records, BAD" in out

    report = restore(str(backup), str(state), partial=True, fsync=False)
    assert report.bad_file == str(segment) and report.lsn == before_last < shipped
    assert recover(str(state))[0].to_dict() == h.states[before_last]


def test_a_segment_cut_at_a_record_boundary_is_found_by_the_whole_file_crc(tmp_path: Path) -> None:
    """Per-record CRCs cannot see a segment that lost its last records whole; the manifest can."""
    _, backup, _, _ = _shipped_history(tmp_path)
    segment = backup / read_manifest(str(backup)).files[-1].name
    data = segment.read_bytes()
    first_len = int.from_bytes(data[HEADER.size:HEADER.size + 4], "little")
    segment.write_bytes(data[:HEADER.size + FRAME.size + first_len])  # only the first record left
    report = verify(str(backup))
    assert not report.ok and report.first_bad.path == str(segment)
    with pytest.raises(BackupError, match=f"{segment}: .* bytes, the manifest says"):
        restore(str(backup), str(tmp_path / "restored"), fsync=False)


def test_restore_refuses_a_non_empty_state_directory_unless_forced(tmp_path: Path) -> None:
    h, backup, _, shipped = _shipped_history(tmp_path)
    state = Path(h.store.state_dir)
    before = sorted(p.name for p in state.iterdir())
    with pytest.raises(BackupError, match="is not empty"):
        restore(str(backup), str(state), fsync=False)
    assert sorted(p.name for p in state.iterdir()) == before
    report = restore(str(backup), str(state), force=True, fsync=False)
    assert sorted(p.name for p in Path(report.replaced).iterdir()) == before  # moved aside, not deleted
    assert recover(str(state))[0].to_dict() == h.states[shipped]


def test_a_ship_that_crashed_before_its_manifest_leaves_the_backup_as_it_was(tmp_path: Path) -> None:
    h, backup, _, shipped = _shipped_history(tmp_path)
    stray = backup / f"wal-{shipped:020d}.log"
    stray.write_bytes(b"half a segment")  # written, renamed, and the manifest never followed
    shutil.rmtree(h.store.state_dir)
    report = restore(str(backup), str(tmp_path / "state"), fsync=False)
    assert report.lsn == shipped and report.bad_file is None
    assert recover(str(tmp_path / "state"))[0].to_dict() == h.states[shipped]
