"""Who may call what on the fleet's internal services: one table, read by every internal server.
Pure: the requests are read by their field names, nothing here imports grpc.

Every method of an internal server is in ``RULES`` or refused (PERMISSION_DENIED, the caller's
identity and the method in one log line: ``kvfleet.core.access_guard``). A rule names the identity
kinds (``kvfleet.core.identity``) that may call the method and, for the methods a node calls about
itself, which node ids the request names: a node may name only its own. The sequences a node
names by id (extend, commit, release, apply) are checked where their node is known, in the page
table (``kvfleet.block_service.server``): ``OWN_SEQUENCES`` marks those methods here.

    BlockManager  the nodes: their own pool and sequences; the router: prefix matches, fleet stats,
                  dropping a node whose etcd lease ended; admin: tenants, node removal, every read;
                  a block_service standby: the leader's log
    Compute       the router starts requests and reads stats; admin reads stats; any node fetches
                  KV blocks from any peer (the holder fences them by tenant)
    Health, reflection   any identity of the cluster (the handshake has proved its certificate)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfleet.core.identity import ADMIN, BLOCK_SERVICE, NODE, ROUTER, Identity

ANY = frozenset({ADMIN, BLOCK_SERVICE, NODE, ROUTER})


def _no_nodes(request) -> Iterable[str]:
    return ()


@dataclass(frozen=True, slots=True)
class Rule:
    callers: frozenset[str]
    # the node ids a request names; a node caller must be each of them ("" counts as naming none)
    nodes_named: Callable[[object], Iterable[str]] = _no_nodes
    # a node caller names at least one node (a node's Stats names itself, never "every node")
    node_must_name_itself: bool = False
    # the sequences it names by id must live on the calling node (checked by the servicer)
    own_sequences: bool = False


def _rule(*callers: str, **kw) -> Rule:
    return Rule(frozenset(callers), **kw)


def _allocations(request) -> Iterable[str]:
    return (s.node_id for s in request.sequences)


def _apply_tiers(request) -> Iterable[str]:
    return (request.tiers.node_id,) if request.HasField("tiers") else ()


BLOCK_MANAGER, COMPUTE = "/kvfleet.v1.BlockManager/", "/kvfleet.v1.Compute/"
HEALTH, REFLECTION = "/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/"

RULES: dict[str, Rule] = {
    BLOCK_MANAGER + "AllocateMany": _rule(NODE, nodes_named=_allocations),
    BLOCK_MANAGER + "ExtendMany": _rule(NODE, own_sequences=True),
    BLOCK_MANAGER + "CommitMany": _rule(NODE, own_sequences=True),
    BLOCK_MANAGER + "ReleaseMany": _rule(NODE, own_sequences=True),
    BLOCK_MANAGER + "ApplyMany": _rule(NODE, nodes_named=_apply_tiers, own_sequences=True),
    BLOCK_MANAGER + "RegisterNode": _rule(NODE, nodes_named=lambda r: (r.node_id,), node_must_name_itself=True),
    BLOCK_MANAGER + "SyncNode": _rule(NODE, nodes_named=lambda r: (r.pool.node_id,), node_must_name_itself=True),
    # the router drops the pool of a node whose etcd lease ended; a node drops its own at exit
    BLOCK_MANAGER + "DeregisterNode": _rule(ADMIN, ROUTER, NODE, nodes_named=lambda r: (r.node_id,),
                                            node_must_name_itself=True),
    BLOCK_MANAGER + "ConfigureTenants": _rule(ADMIN),
    # a node asks where a prompt's prefix is held before it fetches it from a peer (kv_fetch)
    BLOCK_MANAGER + "MatchPrefix": _rule(ADMIN, ROUTER, NODE),
    # the router pins a request's prompt on the node it chose (cache.pin); admin for tools
    BLOCK_MANAGER + "PinPrefix": _rule(ADMIN, ROUTER),
    BLOCK_MANAGER + "Stats": _rule(ADMIN, ROUTER, NODE, nodes_named=lambda r: r.node_ids, node_must_name_itself=True),
    BLOCK_MANAGER + "GetSequences": _rule(ADMIN),
    BLOCK_MANAGER + "FollowLog": _rule(BLOCK_SERVICE),
    COMPUTE + "Serve": _rule(ROUTER),
    COMPUTE + "Stats": _rule(ADMIN, ROUTER),
    COMPUTE + "FetchBlocks": _rule(NODE),
    HEALTH + "Check": Rule(ANY),
    HEALTH + "Watch": Rule(ANY),
    REFLECTION + "ServerReflectionInfo": Rule(ANY),
}


def refusal(method: str, caller: Identity, request: object | None) -> str | None:
    """Why ``caller`` may not call ``method`` with ``request`` (None for a streamed request: only
    the caller is checked), or None when it may."""
    rule = RULES.get(method)
    if rule is None:
        return f"{method} is not open to any identity"
    if caller.kind not in rule.callers:
        allowed = ", ".join(sorted(k if k != NODE else "node:<id>" for k in rule.callers))
        return f"{caller} may not call {method} (only {allowed})"
    if caller.kind != NODE or request is None:
        return None
    named = [n for n in rule.nodes_named(request) if n]
    if rule.node_must_name_itself and not named:
        return f"{caller} must name its own node in {method}"
    others = sorted({n for n in named if n != caller.node_id})
    if others:
        return f"{caller} may not act for node {', '.join(repr(n) for n in others)} in {method}"
    return None


def foreign_sequences(caller: Identity | None, seq_nodes: Iterable[tuple[str, str | None]]) -> str | None:
    """For an ``own_sequences`` method: why a node caller may not touch these (seq id, its node;
    None when unknown) pairs, or None. Unknown sequences are the page table's to refuse."""
    if caller is None or caller.kind != NODE:
        return None
    foreign = [seq for seq, node in seq_nodes if node is not None and node != caller.node_id]
    if not foreign:
        return None
    shown = ", ".join(repr(s) for s in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    return f"{caller} may not touch sequences of another node: {shown}"
