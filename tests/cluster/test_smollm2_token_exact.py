"""The real model: SmolLM2-135M-Instruct, converted by ``kvfleet models pull smollm2``, answers
greedily token for token as transformers (float32, loading the same directory) does, in process
and through a real cluster (etcd, block_service, a node, the router)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.cli.models_pull import pull

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
PROMPTS = [  # ChatML by hand, short: 30 layers on a shared CPU
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nIs ice cold?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWrite the number 12345 backwards.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return pull("smollm2", ROOT / "models")[0]


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (eos included when it comes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(out[0, ids.shape[1]:].tolist())
    assert "Paris" in tokenizer.decode(answers[0])  # the model is the real one, not random weights
    return answers


def test_engine_in_process_matches_transformers(smollm2, reference):
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams

    engine = LLMEngine(smollm2, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=32 << 20))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    texts: dict[str, str] = {rid: "" for rid in tokens}

    def collect(out) -> None:
        tokens[out.request_id] += out.new_token_ids
        texts[out.request_id] += out.new_text

    for i, prompt in enumerate(PROMPTS):  # one batch: prefills and decodes of different lengths together
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), on_output=collect)
    while engine.has_unfinished_requests():
        engine.step()
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    assert texts["0"].startswith("The capital of France is Paris")


@pytest.mark.cluster
def test_cluster_matches_transformers(smollm2, reference, tmp_path):
    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.core import rpc
    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    cluster = LocalCluster(smollm2, 1, work_dir=tmp_path / "cluster", block_size=16, kv_cache_memory=32 << 20,
                           dtype="float32")
    try:
        cluster.start()
        with rpc.sync_channel(cluster.router_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            got = []
            for i, prompt in enumerate(PROMPTS):
                req = inference_pb2.GenerateRequest(request_id=f"exact-{i}", text=prompt,
                                                    sampling=inference_pb2.SamplingParams(max_tokens=MAX_TOKENS))
                chunks = list(stub.Generate(req, metadata=[("authorization", "Bearer sk-gold")], timeout=300))
                got.append([t for c in chunks for t in c.token_ids])
    finally:
        cluster.stop()
    assert got == reference
