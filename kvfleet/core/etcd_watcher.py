"""aetcd's ``Watcher`` with every watch's creation matched to its answer by id.

aetcd creates watches on one stream, one at a time, and binds etcd's ``created`` answer to
whichever creation is pending when the answer arrives. A creation that timed out (the client's
timeout, 5 s) leaves its answer on the way; when it lands while the *next* creation is pending, that
next watch is bound to the first one's id: it receives the other key range's events and never its
own. Seen in the partition bed's lossy soak (10% loss, 200 ms delay): a deposed block_service leader's
leader watch was bound to its step-down watch of ``/kvfleet/nodes/``, so it never saw the new
leader, never followed it as a standby, and the new leader acknowledged every change alone (each
one waiting for a durable mark in etcd) for the rest of the soak.

Here each creation carries an id of its own (etcd's ``WatchCreateRequest.watch_id``, which aetcd
accepts and then drops), unique for the watcher's life, and a ``created`` answer binds only the
creation that asked for that id; any other (a late answer to a creation given up on) is cancelled
at once. Everything else is aetcd's.
"""

from __future__ import annotations

import itertools

from aetcd import exceptions, rtypes, watcher


class Watcher(watcher.Watcher):
    def __init__(self, watchstub, timeout=None, metadata=None) -> None:
        super().__init__(watchstub, timeout=timeout, metadata=metadata)
        self._ids = itertools.count(1)     # never reused: a late answer can never match a later creation
        self._pending_id: int | None = None  # the id the pending creation (``_new_callback``) asked for

    async def add_callback(self, key: bytes, callback, **kwargs) -> watcher.WatcherCallback:
        kwargs["watch_id"] = next(self._ids)  # a caller's own id is replaced: ids must stay unique here
        return await super().add_callback(key, callback, **kwargs)

    def _build_watch_create_request(self, key: bytes, *args, watch_id: int | None = None, **kwargs):
        """aetcd's request with the id set (called under the lock, once ``_new_callback`` is set)."""
        request = super()._build_watch_create_request(key, *args, **kwargs)
        if watch_id:
            request.create_request.watch_id = watch_id
        self._pending_id = watch_id
        return request

    def _answers_pending(self, response) -> bool:
        return self._new_callback is not None and response.watch_id == self._pending_id

    async def _handle_response(self, response) -> None:
        """aetcd's, but a ``created`` answer binds only the creation that asked for its id."""
        async with self._lock:
            if response.created:
                if not self._answers_pending(response):  # its creation was given up on
                    await self._enqueue_watch_cancel(watch_id=response.watch_id)
                    return
                if response.compact_revision != 0:
                    self._new_callback.error = exceptions.RevisionCompactedError(response.compact_revision)
                    return
                self._callbacks[response.watch_id] = self._new_callback
                self._new_callback.watch_id = response.watch_id
                self._new_callback_ready.notify_all()
            watcher_callback = self._callbacks.get(response.watch_id)
        if watcher_callback is None:  # leftovers of a cancelled watch
            return
        if response.compact_revision != 0:
            await self._process_callback(watcher_callback, exceptions.RevisionCompactedError(response.compact_revision))
            await self.cancel(response.watch_id)
            return
        for event in response.events:
            await self._process_callback(watcher_callback, rtypes.Event(
                event.type, event.kv, event.prev_kv if watcher_callback.prev_kv else None))
