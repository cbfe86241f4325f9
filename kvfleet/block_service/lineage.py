"""A state directory's lineage: which history its records belong to. Pure.

Two block_service replicas replicate one history: the leader's first start writes a random id in
``LINEAGE`` next to its snapshots, and a standby that replicates it records the same id. A standby
whose directory holds another id (it replicated another cluster, or was restored from another
backup) must not take records on top of a state they were never made on: it refuses to start with
one line (``lineage_mismatch``) instead of mixing two histories. A directory without the file is
empty or older than replication: it takes the leader's id.
"""

from __future__ import annotations

import os
import uuid

LINEAGE_FILE = "LINEAGE"


def read_lineage(state_dir: str) -> str | None:
    try:
        with open(os.path.join(state_dir, LINEAGE_FILE)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_lineage(state_dir: str, lineage: str) -> None:
    """Record ``lineage`` (written to a temporary file, fsynced, renamed)."""
    from kvfleet.block_service.snapshot import write_atomically

    os.makedirs(state_dir, exist_ok=True)
    write_atomically(state_dir, LINEAGE_FILE, (lineage + "\n").encode())


def ensure_lineage(state_dir: str) -> str:
    """The directory's lineage, a new one recorded when it has none (a leader's first start)."""
    lineage = read_lineage(state_dir)
    if lineage is None:
        lineage = uuid.uuid4().hex
        write_lineage(state_dir, lineage)
    return lineage


def lineage_mismatch(state_dir: str, mine: str | None, leader: str, leader_address: str) -> str | None:
    """One line for a person when a standby with lineage ``mine`` must not follow ``leader``."""
    if mine is None or mine == leader:
        return None
    return (f"the state in {state_dir} has lineage {mine}, the leader at {leader_address} has {leader}: "
            f"they hold different histories; move {state_dir} aside to start this standby empty")


RESET_MARKER = "RESETTING"


def mark_reset(state_dir: str) -> None:
    """A standby is about to replace its whole state with the leader's snapshot: until
    :func:`clear_reset`, this directory holds part of a state or none, and must never lead."""
    from kvfleet.block_service.snapshot import write_atomically

    write_atomically(state_dir, RESET_MARKER, b"replacing this state with the leader's snapshot\n")


def clear_reset(state_dir: str) -> None:
    try:
        os.remove(os.path.join(state_dir, RESET_MARKER))
    except FileNotFoundError:
        pass


def reset_interrupted(state_dir: str) -> bool:
    """A crash stopped a reset half way: this replica's state is empty or partial, so it may campaign
    only after it has followed a leader again (else, with the other replica gone, an empty replica
    would win the election and serve an empty page table)."""
    return os.path.exists(os.path.join(state_dir, RESET_MARKER))
