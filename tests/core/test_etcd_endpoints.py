"""``--etcd``'s list of members and the member a client talks to (kvfleet.core.etcd_endpoints): pure."""

from __future__ import annotations

import pytest

from kvfleet.core.etcd_endpoints import Endpoint, EndpointRotation, EtcdEndpoints, parse_endpoints


def test_one_member_as_before():
    assert parse_endpoints("127.0.0.1:2379") == EtcdEndpoints("http", (Endpoint("127.0.0.1", 2379),))
    assert parse_endpoints("http://etcd") == EtcdEndpoints("http", (Endpoint("etcd", 2379),))
    assert parse_endpoints("https://etcd.kvfleet:4001").tls


def test_several_members_share_the_scheme_written_on_any():
    endpoints = parse_endpoints("https://etcd-0:2379, etcd-1:2380,etcd-2")
    assert endpoints.scheme == "https"
    assert endpoints.members == (Endpoint("etcd-0", 2379), Endpoint("etcd-1", 2380), Endpoint("etcd-2", 2379))
    assert endpoints.url == "https://etcd-0:2379,https://etcd-1:2380,https://etcd-2:2379"
    assert parse_endpoints(endpoints.url) == endpoints
    assert parse_endpoints("a:1,b:2").scheme == "http"


def test_an_ipv6_member_keeps_its_brackets_in_the_target():
    assert parse_endpoints("http://[::1]:2379").members[0].target == "[::1]:2379"


@pytest.mark.parametrize("text, said", [
    ("", "etcd URL"), ("a:1,,b:2", "etcd URL"), ("grpc://x:1", "etcd URL"), ("http://:2379", "etcd URL"),
    ("http://a:port", "etcd URL"), ("http://a:1/path", "etcd URL"),
    ("http://a:1,https://b:1", "all be http:// or all https://"), ("a:1,http://a:1", "named twice"),
])
def test_what_is_not_a_list_of_members_is_said_in_one_line(text, said):
    with pytest.raises(ValueError, match=said) as raised:
        parse_endpoints(text)
    assert "\n" not in str(raised.value)


def test_a_failure_moves_the_client_once_round_the_ring():
    rotation = EndpointRotation(3)
    assert rotation.move_past(0) and rotation.current == 1
    assert not rotation.move_past(0) and rotation.current == 1  # a second call that failed on 0: no skip
    assert rotation.move_past(1) and rotation.move_past(2) and rotation.current == 0


def test_one_member_never_moves():
    rotation = EndpointRotation(1)
    assert not rotation.move_past(0) and rotation.current == 0
    with pytest.raises(ValueError, match="at least one"):
        EndpointRotation(0)
