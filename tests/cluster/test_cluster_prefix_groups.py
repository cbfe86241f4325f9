"""Prefix groups through a real cluster (processes): two tenants of one group share a system prompt's
cached blocks (the router sends the second to the node holding them, its chain salted with the group
the API key names), a tenant outside the group prefills the same prompt in full, a client cannot
choose the salt, and sharing changes no token. Between nodes, a group mate's blocks are fetched."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, released_pool, request, stream, tokens_of
from node_direct import generate_on, metric, node_metrics

from kvfleet.core import certs, rpc, tls
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.identity import Identity
from kvfleet.v1 import compute_pb2, compute_pb2_grpc

GROUPS = """\
prefix_groups: [acme]
tenants:
  - {name: acme-a, api_key: sk-a, quota_mib: 64, paid_level: 1, max_concurrent: 4, prefix_group: acme}
  - {name: acme-b, api_key: sk-b, quota_mib: 64, paid_level: 1, max_concurrent: 4, prefix_group: acme}
  - {name: other, api_key: sk-c, quota_mib: 64, paid_level: 1, max_concurrent: 4}
"""
SYSTEM_BLOCKS = 6


def answer(cluster, prompt: list[int], key: str) -> tuple[list[int], int, str]:
    """(tokens, cached prompt tokens, node) of one greedy request through the router's gRPC door."""
    chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=12, ignore_eos=True), api_key=key)
    return tokens_of(chunks), chunks[-1].usage.cached_tokens, chunks[-1].node_id


def served_by(cluster, holder: str, tenant: str, group: str, hashes: list[bytes]) -> int:
    """How many of ``hashes`` ``holder`` serves to a peer (node-1's certificate) asking for ``tenant``
    with ``group``: its FetchBlocks run's length."""
    asker = Identity.node("node-1")
    creds = tls.Credentials.load(certs.identity_dir(cluster.certs.root, asker), asker)

    async def ask():
        address = f"127.0.0.1:{cluster.nodes[holder].port}"
        async with rpc.channel(address, peer=Identity.node(holder), credentials=creds,
                               max_receive_bytes=rpc.MAX_MESSAGE_BYTES) as channel:
            request = compute_pb2.FetchBlocksRequest(tenant=tenant, block_hashes=b"".join(hashes), prefix_group=group)
            chunks = [c async for c in compute_pb2_grpc.ComputeStub(channel).FetchBlocks(request, timeout=60)]
        return len(chunks[0].header.blocks)

    return asyncio.run(ask())


def test_a_group_shares_a_system_prompt_and_nobody_else_does(start_cluster, tmp_path):
    tenants = tmp_path / "groups.yaml"
    tenants.write_text(GROUPS)
    cluster = start_cluster(2, tenants_file=tenants, compute_args=("--kv-fetch", "off"))
    prompt = random_prompt(SYSTEM_BLOCKS * BLOCK_SIZE + 5, seed=307)

    alone, cached, node = answer(cluster, prompt, "sk-a")
    assert cached == 0 and len(alone) == 12
    mate, mate_cached, mate_node = answer(cluster, prompt, "sk-b")
    assert mate_node == node                            # routed by the group's chain to its blocks
    assert mate_cached == SYSTEM_BLOCKS * BLOCK_SIZE   # a's system prompt, not prefilled again
    assert mate == alone                                # float32: a shared prefix changes no token
    outsider, outsider_cached, _ = answer(cluster, prompt, "sk-c")
    assert outsider_cached == 0 and outsider == alone  # same prompt, its own salt: a full prefill
    again, again_cached, _ = answer(cluster, prompt, "sk-c")
    assert again_cached == SYSTEM_BLOCKS * BLOCK_SIZE and again == alone  # its own chain still hits

    body = {"model": "x", "prompt": prompt, "max_tokens": 2, "cache_salt": "acme"}
    refused = httpx.post(cluster.http_url + "/completions", json=body, headers={"Authorization": "Bearer sk-c"})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "cache_salt"
    assert "API key" in error["message"] and "prefix_group" in error["message"] and "\n" not in error["message"]
    for node_id in block_pools(cluster):
        released_pool(cluster, node_id)  # every request ended: nothing left charged


def test_a_group_mates_blocks_are_fetched_from_the_peer_holding_them(start_cluster, tmp_path):
    tenants = tmp_path / "groups.yaml"
    tenants.write_text(GROUPS)
    cluster = start_cluster(2, tenants_file=tenants, compute_args=("--kv-fetch", "always"))
    prompt = random_prompt(SYSTEM_BLOCKS * BLOCK_SIZE + 5, seed=311)

    def on(node_id, rid, tenant, group=""):
        return asyncio.run(generate_on(cluster, node_id, rid, prompt, 12, tenant=tenant, prefix_group=group))

    first = on("node-0", "a-1", "acme-a", "acme")
    assert not first.error and first.cached_tokens == 0
    chain = block_hashes(prompt, BLOCK_SIZE, tenant_extra_key("acme-a", prefix_group="acme"))[:SYSTEM_BLOCKS]
    assert served_by(cluster, "node-0", "acme-b", "acme", chain) == SYSTEM_BLOCKS  # a group mate's salt
    assert served_by(cluster, "node-0", "other", "", chain) == 0       # asked outside the group: fenced
    assert served_by(cluster, "node-0", "other", "globex", chain) == 0  # asked from another group: fenced
    assert "held under another salt" in cluster.nodes["node-0"].log_path.read_text()
    outsider = on("node-1", "c-1", "other")              # its chain is not the group's: nothing to fetch
    assert not outsider.error and outsider.cached_tokens == 0 and outsider.tokens == first.tokens
    mate = on("node-1", "b-1", "acme-b", "acme")         # node-0 serves the group's blocks to a group mate
    assert not mate.error and mate.tokens == first.tokens
    assert mate.cached_tokens == SYSTEM_BLOCKS * BLOCK_SIZE
    assert metric(node_metrics(cluster, "node-1"), "kvfleet:kv_fetch_blocks_total") == SYSTEM_BLOCKS
    for node_id in ("node-0", "node-1"):
        released_pool(cluster, node_id)
