"""etcd's users and roles for the fleet's identities, so that a node may write only its own key.

etcd started with ``--client-cert-auth`` (``kvfleet.cli.etcd_server``) takes a client certificate's
common name as the user once auth is on: the identity (``kvfleet.core.identity``), ``node:node-0`` with
its colon. Each identity gets a user of that name with no password and a role of the same name:

    router          read    /kvfleet/                      membership, the block_service leader
    block-service   read    /kvfleet/, readwrite /kvfleet/block_service/  its election and marks
    node:<id>       read    /kvfleet/, readwrite /kvfleet/nodes/<id>       its own registration
                    and /kvfleet/block_service/unreachable/<id> only  its complaint about the leader
    admin, root     the root role (everything, users and roles included)

etcd wants a ``root`` user holding the ``root`` role before it turns auth on; it has no password
and the cluster CA issues no ``root`` certificate, so nobody logs in as it. ``apply`` converges
etcd to this table (a user, role or permission that is missing is added, a permission the table
no longer names is revoked) and then turns auth on: a second run, or one naming another node
later, changes only what differs. Users of nodes it is not told of are left as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import aetcd
import grpc
from aetcd import rpc

from kvfleet.core.backoff import Backoff
from kvfleet.core.etcd_endpoints import parse_endpoints
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, ROUTER_ID, Identity
from kvfleet.core.leader import LEADER_KEY, unreachable_key
from kvfleet.core.membership import etcd_client, node_key
from kvfleet.core.tls import Credentials

ROOT = "root"  # etcd's own: the user auth needs, and the role that may do everything
FLEET_PREFIX = "/kvfleet/"
BLOCK_SERVICE_PREFIX = LEADER_KEY.rsplit("/", 1)[0] + "/"  # /kvfleet/block_service/
READ, READWRITE = rpc.Permission.READ, rpc.Permission.READWRITE


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """One permission of a role: ``key`` alone (``range_end`` empty) or the range [key, range_end)."""

    key: bytes
    range_end: bytes
    perm: int  # rpc.Permission.READ / WRITE / READWRITE


def prefix_grant(prefix: str, perm: int) -> Grant:
    """Every key under ``prefix`` (etcd's range end of a prefix: its last byte plus one)."""
    raw = prefix.encode()
    return Grant(raw, raw[:-1] + bytes([raw[-1] + 1]), perm)


def roles(node_ids: Iterable[str]) -> dict[str, frozenset[Grant]]:
    """Role (= user = identity) name -> its permissions, for the router, block_service and these nodes."""
    read_all = prefix_grant(FLEET_PREFIX, READ)
    table = {str(ROUTER_ID): frozenset({read_all}),
             str(BLOCK_SERVICE_ID): frozenset({read_all, prefix_grant(BLOCK_SERVICE_PREFIX, READWRITE)})}
    for node_id in node_ids:
        table[str(Identity.node(node_id))] = frozenset({read_all, Grant(node_key(node_id), b"", READWRITE),
                                                        Grant(unreachable_key(node_id), b"", READWRITE)})
    return table


@dataclass(slots=True)
class Applied:
    """What one ``apply`` changed."""

    users_added: list[str]
    roles_changed: list[str]  # added, or a permission granted or revoked
    enabled_now: bool         # auth was off and is on now


def _grant(perm: rpc.Permission) -> Grant:
    return Grant(perm.key, perm.range_end, perm.permType)


async def apply(auth: rpc.AuthStub, node_ids: Iterable[str], timeout_s: float = 10.0) -> Applied:
    """Converge etcd's users and roles to ``roles(node_ids)`` and turn auth on, through ``auth``
    (the Auth stub of a client holding admin's certificate, or any while auth is off)."""
    table = roles(node_ids)
    enabled = (await auth.AuthStatus(rpc.AuthStatusRequest(), timeout=timeout_s)).enabled
    users = set((await auth.UserList(rpc.AuthUserListRequest(), timeout=timeout_s)).users)
    existing_roles = set((await auth.RoleList(rpc.AuthRoleListRequest(), timeout=timeout_s)).roles)
    done = Applied([], [], enabled_now=not enabled)
    for role in [ROOT, *table]:
        if role not in existing_roles:
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=timeout_s)
            done.roles_changed.append(role)
    for role, grants in table.items():
        have = {_grant(p) for p in (await auth.RoleGet(rpc.AuthRoleGetRequest(role=role), timeout=timeout_s)).perm}
        for grant in sorted(grants - have):
            perm = rpc.Permission(permType=grant.perm, key=grant.key, range_end=grant.range_end)
            await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm), timeout=timeout_s)
        ranges = {(grant.key, grant.range_end) for grant in grants}
        for grant in sorted(g for g in have - grants if (g.key, g.range_end) not in ranges):  # a new type replaces
            await auth.RoleRevokePermission(rpc.AuthRoleRevokePermissionRequest(
                role=role, key=grant.key, range_end=grant.range_end), timeout=timeout_s)
        if have != grants and role not in done.roles_changed:
            done.roles_changed.append(role)
    members = {ROOT: ROOT, str(ADMIN_ID): ROOT, **{role: role for role in table}}
    for user, role in members.items():
        if user not in users:
            options = rpc.UserAddOptions(no_password=True)
            await auth.UserAdd(rpc.AuthUserAddRequest(name=user, options=options), timeout=timeout_s)
            done.users_added.append(user)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=role), timeout=timeout_s)  # idempotent
    if not enabled:
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout_s)
    return done


async def apply_at(url: str, credentials: Credentials, node_ids: Iterable[str], wait_s: float = 30.0) -> Applied:
    """``apply`` on the etcd at ``url`` (https; one member or several), as ``credentials``
    (admin's); waits up to ``wait_s`` for etcd to answer (an init step may start before it)."""
    if not parse_endpoints(url).tls:
        raise ValueError(f"etcd auth takes client certificates, so an https:// etcd; got {url!r}")
    node_ids = list(node_ids)
    deadline, backoff = time.monotonic() + wait_s, Backoff()
    async with etcd_client(url, credentials=credentials) as client:
        while True:  # etcd not up yet: UNAVAILABLE, with the handshake's complaint when it is one
            try:
                await client.status()  # a member that answers: the client moves past those that do not
                await client.auth_stub.AuthStatus(rpc.AuthStatusRequest(), timeout=5.0)
                break
            except (aetcd.ConnectionFailedError, grpc.aio.AioRpcError) as err:
                unavailable = not isinstance(err, grpc.aio.AioRpcError) or err.code() in (
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # or electing its raft leader
                if not unavailable or time.monotonic() > deadline:
                    raise (err.__cause__ if isinstance(err.__cause__, grpc.aio.AioRpcError) else err) from None
            await asyncio.sleep(backoff.next())
        return await apply(client.auth_stub, node_ids)


def enable(url: str, credentials: Credentials, node_ids: Iterable[str], wait_s: float = 30.0) -> Applied:
    """``apply_at`` from synchronous code (``LocalCluster``, the command)."""
    return asyncio.run(apply_at(url, credentials, node_ids, wait_s))
