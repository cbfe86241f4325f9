"""A leader steps down on complaints etcd still holds, not on a stale view of them (in-process, a
fake etcd whose watches stall after their listing, as over a connection that hangs until the kernel
kills it: ETIMEDOUT over the lossy soak's link). Both nodes complained for a moment and withdrew;
the withdrawals never reached the stalled watches, and the leader stepped down on complaints nobody
made any more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvfleet.block_service.step_down_watch import StepDownWatch
from kvfleet.core.leader import UNREACHABLE_PREFIX
from kvfleet.core.membership import NODES_PREFIX

ME = "10.0.0.3:7100"


class _Listing(list):
    def __init__(self, items, revision: int) -> None:
        super().__init__(items)
        self.header = SimpleNamespace(revision=revision)


class _StalledWatchEtcd:
    """Two live nodes; the complaints etcd holds are ``self.against``; every watch stalls."""

    def __init__(self) -> None:
        self.against = {"node-0": ME, "node-1": ME}
        self.reads = 0

    async def get_prefix(self, prefix: bytes):
        self.reads += 1
        if prefix.decode() == NODES_PREFIX:
            items = [SimpleNamespace(key=f"{NODES_PREFIX}{n}".encode(), value=b"{}") for n in ("node-0", "node-1")]
        else:
            items = [SimpleNamespace(key=f"{UNREACHABLE_PREFIX}{n}".encode(), value=a.encode())
                     for n, a in self.against.items()]
        return _Listing(items, 5)

    async def watch_prefix(self, prefix: bytes, start_revision=None):
        class Stalled:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await asyncio.Event().wait()

            async def cancel(self):
                return None

        return Stalled()


async def _steps_down_within(etcd: _StalledWatchEtcd, seconds: float, withdraw: bool) -> bool:
    now = [100.0]
    watch = StepDownWatch(etcd, ME, ttl_s=3, standby_ready=lambda: True, clock=lambda: now[0])
    due = asyncio.create_task(watch.until_due())
    await asyncio.sleep(0.05)              # both prefixes listed, complaints and all
    if withdraw:
        etcd.against.clear()               # both withdrew; the stalled watches never say so
    now[0] += 10.0                         # past the cool-down
    done, _ = await asyncio.wait({due}, timeout=seconds)
    due.cancel()
    await asyncio.gather(due, return_exceptions=True)
    await watch.close()
    return bool(done)


def test_no_step_down_on_withdrawn_complaints_a_stalled_watch_still_shows():
    etcd = _StalledWatchEtcd()
    assert not asyncio.run(_steps_down_within(etcd, 1.0, withdraw=True))
    assert etcd.reads > 2                  # it asked etcd, which holds no complaint


def test_complaints_etcd_still_holds_step_it_down():
    assert asyncio.run(_steps_down_within(_StalledWatchEtcd(), 1.0, withdraw=False))
