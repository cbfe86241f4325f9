"""The cluster CA and its certificates on disk, the identities they name, and a service's check of
its own certificate directory (before anything listens) and of its certificate's expiry (while
it runs)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import shutil
import stat

import pytest

from kvfleet.core import cert_watch, certs, tls
from kvfleet.core.identity import ADMIN_ID, ROUTER_ID, Identity
from kvfleet.core.settings import SettingError
from kvfleet.core.tls_settings import InternalTls

N0 = Identity.node("node-0")


def test_identities_read_and_write_the_same_names():
    for text in ("router", "block-service", "admin", "etcd", "node:node-0", "node:a.b_c-1"):
        assert str(Identity.parse(text)) == text
    assert N0.host_name == "node-0.node.kvfleet" and N0.file_stem == "node-node-0"
    assert ROUTER_ID.host_name == "router.kvfleet"
    for bad in ("root", "node", "node:", "router:x", "node:a/b", "node:-x", "node:" + "x" * 64):
        with pytest.raises(ValueError):
            Identity.parse(bad)


def test_keys_are_private_and_nothing_is_reissued_by_surprise(tmp_path):
    made = certs.ensure(tmp_path, [ROUTER_ID, N0], hosts=["node-0"])
    assert made == [ROUTER_ID, N0]
    for key in (tmp_path / "ca" / certs.CA_KEY_FILE, tmp_path / "node-node-0" / certs.KEY_FILE):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "node-node-0").stat().st_mode) == 0o700
    before = (tmp_path / "node-node-0" / certs.CERT_FILE).read_bytes()
    assert certs.ensure(tmp_path, [ROUTER_ID, N0]) == []  # kvfleet up's second start
    assert not certs.init_ca(tmp_path)
    assert (tmp_path / "node-node-0" / certs.CERT_FILE).read_bytes() == before
    certs.issue(tmp_path, N0, force=True)
    assert (tmp_path / "node-node-0" / certs.CERT_FILE).read_bytes() != before
    info = certs.info(before)
    assert info.identity == N0 and 364 < info.seconds_left() / 86400 < 366


def test_a_service_refuses_a_certificate_directory_that_does_not_hold_in_one_line(tmp_path):
    certs.ensure(tmp_path, [ROUTER_ID, N0])
    node_dir = tmp_path / "node-node-0"
    with pytest.raises(SettingError, match="the certificate is node:node-0's, this service runs as node:node-1"):
        tls.Credentials.load(node_dir, Identity.node("node-1"))
    with pytest.raises(SettingError, match="No such file"):
        tls.Credentials.load(tmp_path / "nowhere", ROUTER_ID)
    other = tmp_path / "other"
    certs.ensure(other, [ROUTER_ID])
    mixed = tmp_path / "mixed"
    shutil.copytree(other / "router", mixed)
    shutil.copy(tmp_path / "ca" / certs.CA_FILE, mixed / certs.CA_FILE)  # another CA's certificate
    with pytest.raises(SettingError, match="not signed by the ca.crt beside it"):
        tls.Credentials.load(mixed, ROUTER_ID)
    old = certs.issue(tmp_path, ADMIN_ID, days=1, not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2))
    with pytest.raises(SettingError, match="admin's certificate expired on"):
        tls.Credentials.load(old, ADMIN_ID)
    swapped = tmp_path / "swapped"
    shutil.copytree(node_dir, swapped)
    shutil.copy(tmp_path / "router" / certs.KEY_FILE, swapped / certs.KEY_FILE)  # another identity's key
    with pytest.raises(SettingError, match="tls.key is not the key of tls.crt"):
        tls.Credentials.load(swapped, N0)
    (swapped / certs.KEY_FILE).write_text("not a key")
    with pytest.raises(SettingError, match="tls.key is not an unencrypted PEM private key"):
        tls.Credentials.load(swapped, N0)
    certs.init_ca(tmp_path / "early-ca")  # a certificate whose validity starts tomorrow
    early = certs.issue(tmp_path / "early-ca", ROUTER_ID, not_before=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1))
    with pytest.raises(SettingError, match="certificate is valid only from"):
        tls.Credentials.load(early, ROUTER_ID)
    with pytest.raises(SettingError, match="need --certs DIR .* or --insecure-internal"):
        InternalTls().require_choice()
    with pytest.raises(SettingError, match="exclude each other"):
        InternalTls(certs=str(node_dir), insecure_internal=True)


def test_a_certificate_near_its_end_is_said_in_the_log_and_then_in_readiness(tmp_path, caplog):
    # valid for 30 more minutes: inside both the warning window and the last hour
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)
    certs.init_ca(tmp_path)
    short = certs.issue(tmp_path, N0, days=1 + 30 / 1440, not_before=start)
    readiness: list[bool] = []

    async def set_ready(ready: bool) -> None:
        readiness.append(ready)

    async def main():
        tls.use(tls.Credentials.load(short, N0))
        try:
            watch = asyncio.create_task(cert_watch.watch_certificate("node node-0", 14.0, set_ready, check_every_s=0.01))
            await asyncio.sleep(0.2)
            watch.cancel()
        finally:
            tls.use(None)

    with caplog.at_level(logging.WARNING, logger="kvfleet.core.cert_watch"):
        asyncio.run(main())
    assert readiness == [False]  # once, not on every check
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "node:node-0 expires in 0.5 hours" in warnings[0], warnings
    assert "kvfleet certs issue node:node-0 --force" in warnings[0]
