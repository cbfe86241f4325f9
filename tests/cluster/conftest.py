"""Process-level fixtures: real servers on loopback, always stopped, even when a test fails."""

import pytest

from kvfleet.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()
