"""Every etcd client pings its member while a call is open, one member as much as several: a watch
only reads, so over a connection whose other end vanished (its RST lost on a lossy link) it would
otherwise wait forever on a key that changed long ago."""

from kvfleet.core.etcd_failover import KEEPALIVE
from kvfleet.core.membership import etcd_client


def test_a_client_of_one_member_pings_it():
    client = etcd_client("http://127.0.0.1:2379")
    for name, value in KEEPALIVE.items():
        assert client._options[name] == value


def test_a_client_of_several_members_pings_them_as_before():
    client = etcd_client("http://127.0.0.1:2379,127.0.0.1:2380")
    assert {k: client._options[k] for k in KEEPALIVE} == KEEPALIVE
