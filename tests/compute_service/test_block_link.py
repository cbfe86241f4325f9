"""The node's view of its link to block_service: which errors are the link's, and its states."""

from __future__ import annotations

import grpc
import pytest

from kvfleet.compute_service.blocks.link import DOWN, LOST, UP, BlockLink, trouble_of
from kvfleet.core.errors import InvalidArgument, NotFound, Unavailable


class RpcError(grpc.RpcError):
    """A transport failure as grpc.aio raises it: ``code()`` names the status."""

    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


@pytest.mark.parametrize("error, trouble", [
    (RpcError(grpc.StatusCode.UNAVAILABLE), DOWN),
    (RpcError(grpc.StatusCode.DEADLINE_EXCEEDED), DOWN),
    (TimeoutError(), DOWN),
    (ConnectionRefusedError(), DOWN),
    (Unavailable("log failed"), DOWN),
    (NotFound("unknown node 'n0'"), LOST),
    (InvalidArgument("bad"), None),
    (RpcError(grpc.StatusCode.INTERNAL), None),
    (RuntimeError("bug"), None),
])
def test_which_errors_are_the_links(error, trouble):
    assert trouble_of(error) == trouble


def test_states_news_and_time_away():
    link = BlockLink()
    assert link.up and link.state == UP
    assert link.lose(LOST, now=10.0)           # news: say it once, start the resync
    assert not link.lose(LOST, now=11.0)
    assert not link.lose(DOWN, now=12.0) and link.state == DOWN  # unreachable wins
    assert not link.lose(LOST, now=13.0) and link.state == DOWN
    assert link.synced(now=15.5) == 5.5 and link.up and link.num_outages == 1
    assert link.synced(now=20.0) == 0.0
    with pytest.raises(ValueError):
        link.lose("gone", now=21.0)


def test_a_new_leader_cuts_the_resync_backoff_short() -> None:
    """The resync waits its backoff between tries; ``retry_now`` (block_service's leader changed)
    makes it try at once instead of at the end of a long delay."""
    import asyncio

    from kvfleet.compute_service.blocks.sync import BlockSync, SyncOutcome
    from kvfleet.core.backoff import Backoff

    async def run() -> int:
        tries = []

        async def sync(periodic: bool) -> SyncOutcome:
            tries.append(periodic)
            if len(tries) == 1:
                raise Unavailable("the old leader is gone")
            return SyncOutcome()

        syncs = BlockSync("n0", sync, backoff=lambda: Backoff(first_s=3600, cap_s=3600))
        syncs.trouble()
        while not tries:
            await asyncio.sleep(0)
        syncs.retry_now()
        while syncs.resyncing:
            await asyncio.sleep(0.01)
        await syncs.close()
        return len(tries)

    assert asyncio.run(asyncio.wait_for(run(), 60)) == 2
