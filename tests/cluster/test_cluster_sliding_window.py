"""A sliding-window model through a real 1-node cluster: greedy tokens equal transformers' well past
the window, the node gives back the blocks outside it as the sequence grows (block_service's own
figures stay O(window) while a long generation streams), and block_service's state, replayed from
its log, holds its invariants afterwards."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from cluster_helpers import block_pools, random_prompt, request

from kvfleet.block_service.durable import recover
from kvfleet.compute_service.blocks.topup_lead import MAX_RESERVE_BLOCKS
from kvfleet.v1 import inference_pb2_grpc
from tests.compute_service.windowed_models import make_windowed_model, transformers_greedy

MAX_TOKENS = 300


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model_dir(request, tmp_path_factory):
    """Overrides conftest's: Mistral (window 24, 2 layers) and Qwen2 (window 40 on all 3 layers),
    hidden 64, built by transformers."""
    return make_windowed_model(tmp_path_factory.mktemp("cluster-windowed") / request.param, request.param)


def test_long_generation_matches_transformers_and_holds_its_window(start_cluster, model_dir, tmp_path):
    window = json.loads((model_dir / "config.json").read_text())["sliding_window"]
    cluster = start_cluster(1)
    prompt = random_prompt(40, seed=3)
    tokens, used, next_sample = [], [], 30
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chunks = stub.Generate(request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True),
                               metadata=[("authorization", "Bearer sk-gold")], timeout=300)
        for chunk in chunks:
            tokens += chunk.token_ids
            # block_service's figures every 30 tokens while the sequence grows (a chunk may carry
            # several tokens when the router reads slower than the node steps)
            while len(tokens) >= next_sample:
                used.append(block_pools(cluster)["node-0"].num_used)
                next_sample += 30
    assert tokens == transformers_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)
    # 340 tokens would fill 22 blocks of 16. Held: the blocks the window reaches, the one being
    # written, its reserve (up to MAX_RESERVE_BLOCKS where block_service's round trips are slow
    # against the steps: a loaded machine), and a drop the node may still be deferring (at most 16
    # steps: a block). Before the top-up lead the reserve was one block: seen 8 > 7 at load 16.
    bound = -(-window // 16) + 1 + MAX_RESERVE_BLOCKS + 1
    assert len(used) == MAX_TOKENS // 30 and max(used) <= bound, used

    state = tmp_path / "state-copy"
    shutil.copytree(cluster.work_dir / "block_state", state)
    table, report = recover(str(state))
    assert report.stop_reason is None
    table.check()
    cached = table.allocator_stats("node-0").num_cached
    assert cached >= 15, "the dropped blocks were committed: they stay in the prefix cache"
