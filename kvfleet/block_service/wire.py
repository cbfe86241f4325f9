"""Conversions between the BlockManager protobuf messages and the page table's dataclasses.

Both directions live here, in pairs, so that server and client agree by construction. Hashes travel
as one ``bytes`` field per prompt (16 bytes per block, concatenated), commits as runs of consecutive
blocks of one sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfleet.block_service.bookkeeping import GROWTH, ApplyResult, ItemError, TierBatch
from kvfleet.block_service.lower_tiers import LOWER_TIERS
from kvfleet.block_service.node_sync import LiveSequence, SyncResult
from kvfleet.block_service.page_table import SeqState
from kvfleet.block_service.pins import TenantPins
from kvfleet.block_service.stats import Counters, Holder, NodeStats, TenantStats, TierBlocks
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, AllocateRequest, Allocation, Refusal, TierChange
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.tenants import Tenant
from kvfleet.v1 import block_manager_pb2 as pb


def split_hashes(data: bytes) -> list[bytes]:
    if len(data) % HASH_BYTES:
        raise InvalidArgument(f"block_hashes must be {HASH_BYTES}-byte hashes concatenated, got {len(data)} bytes")
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


# ---- lower tiers ---------------------------------------------------------------------

_WIRE_TIERS = (TIER_NONE, TIER_HOST, TIER_DISK)  # a move's tier code on the wire is its index here
_TIER_CODES = {t: i for i, t in enumerate(_WIRE_TIERS)}


def tier_changes_to_pb(node_id: str, changes: Sequence[TierChange]) -> pb.TierChanges:
    return pb.TierChanges(node_id=node_id, block_hashes=b"".join(c.block_hash for c in changes),
                          tiers=bytes(_TIER_CODES[c.tier] for c in changes), tenants=[c.tenant for c in changes])


def tier_changes_from_pb(m: pb.TierChanges) -> TierBatch:
    """An unknown tier code becomes a tier the page table refuses (alone, with its reason)."""
    hashes = split_hashes(m.block_hashes)
    if not len(hashes) == len(m.tiers) == len(m.tenants):
        raise InvalidArgument(f"tier moves: {len(hashes)} hashes, {len(m.tiers)} tiers and {len(m.tenants)} tenants")
    return TierBatch(m.node_id, [
        TierChange(h, t, _WIRE_TIERS[code] if code < len(_WIRE_TIERS) else f"code {code}")
        for h, code, t in zip(hashes, m.tiers, m.tenants)])


def matches_to_pb(hot: dict[str, int], lower: dict[str, int], block_size: Callable[[str], int]) -> pb.MatchPrefixResponse:
    return pb.MatchPrefixResponse(nodes=[
        pb.NodePrefixMatch(node_id=n, num_cached_blocks=k, block_size=block_size(n), num_lower_tier_blocks=lower.get(n, 0))
        for n, k in hot.items()])


def matches_from_pb(m: pb.MatchPrefixResponse) -> tuple[dict[str, int], dict[str, int]]:
    """``(hot, lower)`` as ``PageTable.match_tiers`` answers them (``lower``: nodes with any)."""
    return ({n.node_id: n.num_cached_blocks for n in m.nodes},
            {n.node_id: n.num_lower_tier_blocks for n in m.nodes if n.num_lower_tier_blocks})


# ---- refusals -----------------------------------------------------------------------------------

def refusal_to_pb(r: Refusal) -> pb.BlockRefusal:
    return pb.BlockRefusal(reason=r.reason, node_id=r.node_id, tenant=r.tenant, blocks_asked=r.blocks_asked,
                           blocks_charged=r.blocks_charged, blocks_allowed=r.blocks_allowed, message=r.message())


def refusal_from_pb(m: pb.BlockRefusal) -> Refusal:
    return Refusal(m.reason, m.node_id, m.tenant, m.blocks_asked, m.blocks_charged, m.blocks_allowed)


# ---- allocate -----------------------------------------------------------------------------------

def allocate_request_to_pb(requests: Sequence[AllocateRequest]) -> pb.AllocateManyRequest:
    return pb.AllocateManyRequest(sequences=[
        pb.SequenceAllocation(node_id=r.node_id, seq_id=r.seq_id, tenant=r.tenant,
                              block_hashes=b"".join(r.block_hashes), num_tokens=r.num_tokens)
        for r in requests
    ])


def allocate_request_from_pb(m: pb.AllocateManyRequest) -> list[AllocateRequest]:
    return [AllocateRequest(s.node_id, s.seq_id, s.tenant, split_hashes(s.block_hashes), s.num_tokens)
            for s in m.sequences]


def allocate_results_to_pb(results: Sequence[Allocation | Refusal]) -> pb.AllocateManyResponse:
    out = pb.AllocateManyResponse()
    for r in results:
        if isinstance(r, Refusal):
            out.results.add(refusal=refusal_to_pb(r))
        else:
            out.results.add(block_ids=pb.BlockIds(ids=r.block_ids), num_cached_blocks=r.num_cached_blocks)
    return out


def allocate_results_from_pb(m: pb.AllocateManyResponse) -> list[Allocation | Refusal]:
    return [Allocation(list(r.block_ids.ids), r.num_cached_blocks) if r.HasField("block_ids")
            else refusal_from_pb(r.refusal) for r in m.results]


# ---- extend -------------------------------------------------------------------------------------

def extend_request_to_pb(growth: Sequence[tuple[str, int]], tenant: str | None) -> pb.ExtendManyRequest:
    return pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id=s, num_tokens=n) for s, n in growth],
                                tenant=tenant or "")


def extend_request_from_pb(m: pb.ExtendManyRequest) -> list[tuple[str, int]]:
    return [(g.seq_id, g.num_tokens) for g in m.sequences]


def extend_results_to_pb(results: Sequence[list[int] | Refusal]) -> pb.ExtendManyResponse:
    out = pb.ExtendManyResponse()
    for r in results:
        if isinstance(r, Refusal):
            out.results.add(refusal=refusal_to_pb(r))
        else:
            out.results.add(new_block_ids=pb.BlockIds(ids=r))
    return out


def extend_results_from_pb(m: pb.ExtendManyResponse) -> list[list[int] | Refusal]:
    return [list(r.new_block_ids.ids) if r.HasField("new_block_ids") else refusal_from_pb(r.refusal)
            for r in m.results]


# ---- bookkeeping (ApplyMany) -------------------------------------------------------------------

def _item_error_to_pb(e: ItemError) -> pb.ItemError:
    return pb.ItemError(kind=e.kind, index=e.index, seq_id=e.seq_id, code=e.code, message=e.message)


def apply_result_to_pb(r: ApplyResult) -> pb.ApplyManyResponse:
    out = pb.ApplyManyResponse(num_committed=r.num_committed, errors=[_item_error_to_pb(e) for e in r.errors],
                               refused_tier_hashes=b"".join(r.tier_refused))
    for g in r.growth:
        if isinstance(g, Refusal):
            out.growth.results.add(refusal=refusal_to_pb(g))
        elif isinstance(g, ItemError):
            out.growth.results.add()
        else:
            out.growth.results.add(new_block_ids=pb.BlockIds(ids=g))
    return out


def apply_result_from_pb(m: pb.ApplyManyResponse) -> ApplyResult:
    errors = [ItemError(e.kind, e.index, e.seq_id, e.code, e.message) for e in m.errors]
    growth_errors = {e.index: e for e in errors if e.kind == GROWTH}
    growth: list[list[int] | Refusal | ItemError] = [
        list(r.new_block_ids.ids) if r.HasField("new_block_ids")
        else refusal_from_pb(r.refusal) if r.HasField("refusal")
        else growth_errors[i]
        for i, r in enumerate(m.growth.results)
    ]
    return ApplyResult(m.num_committed, growth, errors, split_hashes(m.refused_tier_hashes))


# ---- commit -------------------------------------------------------------------------------------

def commit_request_to_pb(commits: Sequence[tuple[str, int, bytes]], tenant: str | None) -> pb.CommitManyRequest:
    """Consecutive blocks of one sequence become one run."""
    out = pb.CommitManyRequest(tenant=tenant or "")
    run_seq, run_start, run_hashes = None, 0, []
    for seq_id, i, h in commits:
        if seq_id == run_seq and i == run_start + len(run_hashes):
            run_hashes.append(h)
            continue
        if run_seq is not None:
            out.runs.add(seq_id=run_seq, first_block_index=run_start, block_hashes=b"".join(run_hashes))
        run_seq, run_start, run_hashes = seq_id, i, [h]
    if run_seq is not None:
        out.runs.add(seq_id=run_seq, first_block_index=run_start, block_hashes=b"".join(run_hashes))
    return out


def commit_request_from_pb(m: pb.CommitManyRequest) -> list[tuple[str, int, bytes]]:
    return [(run.seq_id, run.first_block_index + k, h)
            for run in m.runs for k, h in enumerate(split_hashes(run.block_hashes))]


# ---- tenants ------------------------------------------------------------------------------------

def tenant_to_pb(t: Tenant) -> pb.TenantQuota:
    return pb.TenantQuota(name=t.name, quota_mib=t.quota_mib, reserved_mib=t.reserved_mib,
                          paid_level=t.paid_level, max_concurrent=t.max_concurrent,
                          lower_tier_quota_mib=t.lower_tier_quota_mib, cache_share_mib=t.cache_share_mib,
                          pinned_mib=t.pinned_mib)


def tenant_from_pb(m: pb.TenantQuota) -> Tenant:
    return Tenant(name=m.name, quota_mib=m.quota_mib if m.HasField("quota_mib") else None,
                  reserved_mib=m.reserved_mib, paid_level=m.paid_level, max_concurrent=m.max_concurrent,
                  lower_tier_quota_mib=m.lower_tier_quota_mib if m.HasField("lower_tier_quota_mib") else None,
                  cache_share_mib=m.cache_share_mib if m.HasField("cache_share_mib") else None,
                  pinned_mib=m.pinned_mib)


# ---- figures and tables -------------------------------------------------------------------------

def _counters_to_pb(c: Counters) -> pb.BlockCounters:
    return pb.BlockCounters(prefix_queries=c.prefix_queries, prefix_hits=c.prefix_hits,
                            refusals_pool=c.refusals_pool, refusals_quota=c.refusals_quota,
                            reconciled_releases=c.reconciled_releases, refusals_lower_tier=c.refusals_lower_tier,
                            evictions=c.evictions)


def _counters_from_pb(m: pb.BlockCounters) -> Counters:
    return Counters(prefix_queries=m.prefix_queries, prefix_hits=m.prefix_hits,
                    refusals_pool=m.refusals_pool, refusals_quota=m.refusals_quota,
                    reconciled_releases=m.reconciled_releases, refusals_lower_tier=m.refusals_lower_tier,
                    evictions=dict(m.evictions))


def node_stats_to_pb(s: NodeStats) -> pb.NodePoolStats:
    return pb.NodePoolStats(
        node_id=s.node_id, num_blocks=s.num_blocks, block_size=s.block_size, bytes_per_block=s.bytes_per_block,
        num_free=s.num_free, num_cached=s.num_cached, num_used=s.num_used, num_sequences=s.num_sequences,
        tokens_stored=s.tokens_stored, token_capacity=s.token_capacity, counters=_counters_to_pb(s.counters),
        transfers_in_flight=s.transfers_in_flight, transfer_blocks_in_flight=s.transfer_blocks_in_flight,
    )


def node_stats_from_pb(m: pb.NodePoolStats) -> NodeStats:
    return NodeStats(
        node_id=m.node_id, num_blocks=m.num_blocks, block_size=m.block_size, bytes_per_block=m.bytes_per_block,
        num_free=m.num_free, num_cached=m.num_cached, num_used=m.num_used, num_sequences=m.num_sequences,
        tokens_stored=m.tokens_stored, token_capacity=m.token_capacity, counters=_counters_from_pb(m.counters),
        lower_tier={t.tier: t.num_cached for t in m.tiers if t.tier in LOWER_TIERS},
        transfers_in_flight=m.transfers_in_flight, transfer_blocks_in_flight=m.transfer_blocks_in_flight,
    )


def tiers_to_pb(s: NodeStats) -> list[pb.TierBlocks]:
    """The pool (device), then the blocks the node holds below it (host, disk: cached only)."""
    return [pb.TierBlocks(tier="device", num_used=s.num_used, num_cached=s.num_cached, num_free=s.num_free),
            *(pb.TierBlocks(tier=t, num_cached=s.lower_tier.get(t, 0)) for t in LOWER_TIERS)]


def tier_from_pb(m: pb.TierBlocks) -> TierBlocks:
    return TierBlocks(tier=m.tier, num_used=m.num_used, num_cached=m.num_cached, num_free=m.num_free)


def holder_to_pb(h: Holder) -> pb.BlockHolder:
    return pb.BlockHolder(seq_id=h.seq_id, tenant=h.tenant, num_blocks=h.num_blocks, num_tokens=h.num_tokens,
                          tail_waste_tokens=h.tail_waste_tokens, age_s=h.age_s, age_at_least=h.age_at_least)


def holder_from_pb(m: pb.BlockHolder) -> Holder:
    return Holder(seq_id=m.seq_id, tenant=m.tenant, num_blocks=m.num_blocks, num_tokens=m.num_tokens,
                  tail_waste_tokens=m.tail_waste_tokens, age_s=m.age_s, age_at_least=m.age_at_least)


def tenant_stats_to_pb(s: TenantStats) -> pb.TenantBlockStats:
    return pb.TenantBlockStats(
        tenant=s.tenant, node_id=s.node_id, blocks_charged=s.blocks_charged, blocks_allowed=s.blocks_allowed,
        blocks_reserved=s.blocks_reserved, num_sequences=s.num_sequences, tokens_stored=s.tokens_stored,
        token_capacity=s.token_capacity, counters=_counters_to_pb(s.counters),
        lower_tier_blocks=s.lower_tier_blocks, lower_tier_allowed=s.lower_tier_allowed,
    )


def tenant_stats_from_pb(m: pb.TenantBlockStats) -> TenantStats:
    return TenantStats(
        tenant=m.tenant, node_id=m.node_id, blocks_charged=m.blocks_charged,
        blocks_allowed=m.blocks_allowed if m.HasField("blocks_allowed") else None,
        blocks_reserved=m.blocks_reserved, num_sequences=m.num_sequences, tokens_stored=m.tokens_stored,
        token_capacity=m.token_capacity, counters=_counters_from_pb(m.counters),
        lower_tier_blocks=m.lower_tier_blocks,
        lower_tier_allowed=m.lower_tier_allowed if m.HasField("lower_tier_allowed") else None,
    )


def sequence_to_pb(s: SeqState) -> pb.SequenceBlocks:
    return pb.SequenceBlocks(seq_id=s.seq_id, node_id=s.node_id, tenant=s.tenant,
                             block_ids=pb.BlockIds(ids=s.block_ids), num_tokens=s.num_tokens,
                             num_committed=s.num_committed)


def sequence_from_pb(m: pb.SequenceBlocks) -> SeqState:
    return SeqState(m.seq_id, m.node_id, m.tenant, list(m.block_ids.ids), m.num_tokens, m.num_committed)


# ---- node sync ----------------------------------------------------------------------------------

def sync_request_to_pb(node_id: str, num_blocks: int, block_size: int, bytes_per_block: int,
                       listed: Sequence[LiveSequence], tiers: Sequence[TierChange] | None = None) -> pb.SyncNodeRequest:
    return pb.SyncNodeRequest(
        lower_tiers=None if tiers is None else tier_changes_to_pb(node_id, tiers),
        pool=pb.RegisterNodeRequest(node_id=node_id, num_blocks=num_blocks, block_size=block_size,
                                    bytes_per_block=bytes_per_block),
        sequences=[pb.LiveSequence(seq_id=s.seq_id, tenant=s.tenant, block_ids=pb.BlockIds(ids=s.block_ids),
                                   num_tokens=s.num_tokens) for s in listed],
    )


def sync_request_from_pb(m: pb.SyncNodeRequest) -> tuple[str, int, int, int, list[LiveSequence], list[TierChange] | None]:
    listed = [LiveSequence(s.seq_id, s.tenant, tuple(s.block_ids.ids), s.num_tokens) for s in m.sequences]
    p = m.pool
    tiers = tier_changes_from_pb(m.lower_tiers).changes if m.HasField("lower_tiers") else None
    return p.node_id, p.num_blocks, p.block_size, p.bytes_per_block, listed, tiers


def sync_result_to_pb(r: SyncResult) -> pb.SyncNodeResponse:
    return pb.SyncNodeResponse(
        registered=r.registered, released_seq_ids=r.released, adopted_seq_ids=r.adopted,
        updated_seq_ids=r.updated, refused=[pb.SequenceRefusal(seq_id=s, reason=why) for s, why in r.refused],
    )


def sync_result_from_pb(m: pb.SyncNodeResponse) -> SyncResult:
    return SyncResult(registered=m.registered, released=list(m.released_seq_ids), adopted=list(m.adopted_seq_ids),
                      updated=list(m.updated_seq_ids), refused=[(r.seq_id, r.reason) for r in m.refused])


# ---- pins ---------------------------------------------------------------------------------------

def tenant_pins_to_pb(p: TenantPins) -> pb.TenantPins:
    return pb.TenantPins(tenant=p.tenant, node_id=p.node_id, pinned_blocks=p.pinned, allowed_blocks=p.allowed,
                         cached_blocks=p.cached, earliest_expiry=p.earliest)


def tenant_pins_from_pb(m: pb.TenantPins) -> TenantPins:
    return TenantPins(m.tenant, m.node_id, m.pinned_blocks, m.allowed_blocks, m.cached_blocks, int(m.earliest_expiry))
