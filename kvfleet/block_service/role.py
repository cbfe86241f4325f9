"""Who may change the page table here: the one check every write passes through. Pure.

A single block_service (no ``--etcd``) always may. A replica may only while it holds the etcd
election (``Election.holds``); otherwise it answers writes UNAVAILABLE naming the leader it knows,
so that a client that reached it by an old address knows where to go. A write is checked before it
changes anything and again before it is acknowledged: a replica deposed while its change was being
made durable answers UNAVAILABLE (the change may or may not survive; the client's resync settles it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.core.errors import Unavailable


def _always() -> bool:
    return True


@dataclass(slots=True)
class Role:
    holds: Callable[[], bool] = field(default=_always)  # this replica leads now
    leader_address: str | None = None                   # the leader as last seen in etcd

    def check_writable(self) -> None:
        if not self.holds():
            where = f"the leader is at {self.leader_address}" if self.leader_address else "no leader is elected yet"
            raise Unavailable(f"this block_service replica is not the leader ({where}); writes go to the leader")
