"""``follow_prefix`` ends when its task is cancelled, even when the cancel reaches it as an etcd error."""

import asyncio

import pytest

from kvfleet.core.etcd_watch import follow_prefix


class Unreachable(Exception):
    """What aetcd raises for a call that failed, the call cancelled under a cancelled task among them."""


class EtcdGone:
    """An etcd client whose every listing fails after a moment; with ``swallow`` the cancel of the
    awaiting task comes out of the call as the client's own exception, as aetcd maps a gRPC call
    cancelled under it."""

    def __init__(self, swallow: bool) -> None:
        self.swallow, self.calls = swallow, 0

    async def get_prefix(self, prefix: bytes):
        self.calls += 1
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if self.swallow:
                raise Unreachable("cancelled") from None
            raise
        raise Unreachable("connection refused")


@pytest.mark.parametrize("swallow", [False, True])
def test_a_cancel_ends_the_loop_however_it_reaches_it(swallow):
    async def scenario() -> int:
        client = EtcdGone(swallow)

        async def follow() -> None:
            async for _ in follow_prefix(client, "/x/", "test", retry_s=0.01):
                pass

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.2)  # a few failed listings and retries
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)  # before: TimeoutError, the loop listing on for ever
        return client.calls

    assert asyncio.run(scenario()) >= 2
