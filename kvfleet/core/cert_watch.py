"""A running service's own certificate, watched: said in the log from ``--cert-warn-days`` before it
expires (every few hours, with what to do), and in readiness in its last hour (NOT_SERVING), so an
orchestrator takes the service out of rotation before its handshakes start failing. Nothing is
renewed by surprise: a new certificate is issued by the operator and takes effect at restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvfleet.core import tls

log = logging.getLogger(__name__)

UNREADY_BEFORE_S = 3600.0
REMIND_EVERY_S = 6 * 3600.0


def _left(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} hours"


async def watch_certificate(service: str, warn_days: float, set_ready: Callable[[bool], Awaitable[None]],
                            check_every_s: float = 60.0) -> None:
    """Until cancelled; nothing to do in plaintext."""
    credentials = tls.current()
    if credentials is None:
        return
    identity, last_warned, unready = credentials.identity, None, False
    while True:
        left = tls.seconds_left() or 0.0
        now = asyncio.get_running_loop().time()
        if left <= warn_days * 86400 and (last_warned is None or now - last_warned >= REMIND_EVERY_S):
            last_warned = now
            what = f"expires in {_left(left)}" if left > 0 else "has EXPIRED: peers refuse this service"
            log.warning("%s: the certificate of %s %s (%s); issue a new one (`kvfleet certs issue %s --force`) "
                        "and restart", service, identity, what, credentials.directory, identity)
        if left <= UNREADY_BEFORE_S and not unready:
            unready = True
            log.error("%s: certificate of %s ends in %s: readiness NOT_SERVING", service, identity, _left(max(left, 0)))
            await set_ready(False)
        await asyncio.sleep(min(check_every_s, max(left - UNREADY_BEFORE_S, 1.0)))
