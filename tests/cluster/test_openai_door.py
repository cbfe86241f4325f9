"""The router's OpenAI-compatible HTTP door, through a real cluster, with the official ``openai``
client: the same tenants, queue, routing and prefix cache as the gRPC door; OpenAI's error shape
and status codes; a client that leaves frees its blocks."""

from __future__ import annotations

import json
import signal
import time

import grpc
import httpx2 as httpx
import openai
import pytest
from cluster_helpers import BLOCK_SIZE, TENANTS, random_prompt, released_pool, request, stream, tokens_of

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.cli.model_maker import make_model
from kvfleet.compute_service.model.tokenizer import Tokenizer
from kvfleet.core.identity import Identity
from kvfleet.v1 import compute_pb2, compute_pb2_grpc, inference_pb2

QUESTION = [{"role": "system", "content": "Answer in Chinese. 请用中文回答 🙂"},
            {"role": "user", "content": "What is a KV cache?"}]


def one_node(model, tmp, **kw) -> LocalCluster:
    """A one-node cluster, not started (``with`` starts and stops it)."""
    tenants = tmp / "tenants.yaml"
    tenants.write_text(TENANTS)
    return LocalCluster(model, 1, tenants_file=tenants, work_dir=tmp / "cluster", block_size=BLOCK_SIZE,
                        kv_cache_memory=16 << 20, dtype="float32", **kw)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with one_node(model_dir, tmp_path_factory.mktemp("openai")) as started:
        yield started


def client(cluster, key="sk-gold") -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url, api_key=key, max_retries=0, timeout=120)


def model_id(cluster) -> str:
    return client(cluster).models.list().data[0].id


def test_models_and_health(cluster, model_dir):
    assert [m.id for m in client(cluster).models.list().data] == [model_dir.name]
    health = httpx.get(cluster.http_url.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_chat_answers_as_the_grpc_door_does(cluster, model_dir):
    answer = client(cluster).chat.completions.create(model=model_id(cluster), messages=QUESTION, max_tokens=12,
                                                     temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    # the gRPC door's chat form: the same template, the same greedy tokens, the same text
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in QUESTION])
    req = inference_pb2.GenerateRequest(chat=chat, sampling=inference_pb2.SamplingParams(max_tokens=12))
    chunks = stream(cluster.router_address, req)
    assert "".join(c.text for c in chunks) == choice.message.content
    rendered = "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in QUESTION) + "<s>assistant\n"
    assert answer.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(Tokenizer(model_dir).encode(rendered))
    assert answer.usage.completion_tokens == len(tokens_of(chunks))
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streaming_adds_up_to_the_whole_answer_with_usage_last(cluster):
    c, model = client(cluster), model_id(cluster)
    kw = dict(model=model, prompt="The fleet", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    events = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 20
    assert all(e.usage is None for e in events[:-1])
    chat = list(c.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length") and chat[-1].usage is None


def test_streamed_text_is_exact_utf8(cluster, model_dir):
    """Random weights emit random bytes: characters split across tokens and outputs that end
    inside one. The text streamed is the decode of the tokens streamed, piece by piece."""
    tokenizer = Tokenizer(model_dir)
    for seed in range(3):
        chunks = stream(cluster.router_address, request(text="你好，世界 🙂", max_tokens=31, temperature=1.0,
                                                        seed=seed + 1, ignore_eos=True))
        assert "".join(c.text for c in chunks) == tokenizer.decode(tokens_of(chunks))


def test_a_shared_prefix_shows_as_cached_tokens(cluster):
    c, model = client(cluster), model_id(cluster)
    prefix = "A long system prompt shared by both requests, long enough for several blocks. " * 3
    first = c.completions.create(model=model, prompt=prefix + "First?", max_tokens=2, temperature=0)
    second = c.completions.create(model=model, prompt=prefix + "Second?", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached <= len(prefix)


@pytest.mark.parametrize("call, error, status, param, words", [
    (lambda c, m: c.chat.completions.create(model=m, messages=QUESTION, n=2), openai.BadRequestError, 400, "n",
     "not supported"),
    (lambda c, m: c.chat.completions.create(model=m, messages=QUESTION, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {}}}]), openai.BadRequestError, 400, "tools", "not supported"),
    (lambda c, m: c.chat.completions.create(model=m, messages=QUESTION, logprobs=True), openai.BadRequestError, 400,
     "logprobs", "not supported"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[]), openai.BadRequestError, 400, "messages",
     "non-empty"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "wizard", "content": "x"}]),
     openai.BadRequestError, 400, "messages[0].role", "unknown"),
    (lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=0), openai.BadRequestError, 400,
     "max_tokens", "between 1"),
    (lambda c, m: c.completions.create(model="gpt-4", prompt="x"), openai.NotFoundError, 404, "model",
     "does not exist"),
])
def test_bad_requests_get_openais_error_shape(cluster, call, error, status, param, words):
    with pytest.raises(error) as info:
        call(client(cluster), model_id(cluster))
    assert info.value.status_code == status and info.value.param == param and words in info.value.message


def test_keys_and_quotas_are_the_grpc_doors(cluster):
    with pytest.raises(openai.AuthenticationError) as info:
        client(cluster, "sk-nobody").models.list()
    assert info.value.status_code == 401 and "unknown API key" in info.value.message
    keyless = httpx.post(cluster.http_url + "/completions", json={"model": "x", "prompt": "y"})
    assert keyless.status_code == 401 and "missing API key" in keyless.json()["error"]["message"]
    # "tiny" may hold 0.1 MiB: 3 blocks of this model; the prompt needs 7
    with pytest.raises(openai.RateLimitError) as info:
        client(cluster, "sk-tiny").completions.create(model=model_id(cluster), prompt=random_prompt(100, 2),
                                                      max_tokens=4)
    assert info.value.status_code == 429 and "quota" in info.value.message


@pytest.mark.parametrize("headers, body, words", [
    ({"content-type": "application/json"}, b"{not json", "not valid JSON"),
    ({"content-type": "text/plain"}, b"{}", "Content-Type must be application/json"),
    ({}, b'{"model": "x", "prompt": "y"}', "Content-Type must be application/json"),
])
def test_a_body_that_is_not_json_is_400(cluster, headers, body, words):
    answer = httpx.post(cluster.http_url + "/chat/completions", content=body,
                        headers={"authorization": "Bearer sk-gold", **headers})
    assert answer.status_code == 400 and words in answer.json()["error"]["message"]
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def node_generated(cluster) -> int:
    with cluster.certs.sync_channel(f"127.0.0.1:{cluster.nodes['node-0'].port}", Identity.node("node-0")) as channel:
        return compute_pb2_grpc.ComputeStub(channel).Stats(compute_pb2.ComputeStatsRequest(), timeout=30).generated_tokens


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_a_client_that_leaves_cancels_its_request_and_frees_its_blocks(cluster, streaming):
    released_pool(cluster)
    before = node_generated(cluster)
    body = {"model": model_id(cluster), "prompt": random_prompt(50, 4), "max_tokens": 4000, "ignore_eos": True,
            "stream": streaming}
    headers = {"authorization": "Bearer sk-gold"}
    if streaming:
        with httpx.stream("POST", cluster.http_url + "/completions", json=body, headers=headers, timeout=60) as r:
            lines = r.iter_lines()
            while sum(1 for _ in range(5) if next(lines).startswith("data: ")) < 3:
                pass
    else:  # the client gives up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(cluster.http_url + "/completions", json=body, headers=headers, timeout=1.0)
    released_pool(cluster)
    assert 0 < node_generated(cluster) - before < 4000  # stopped, not run to the end


def test_grpc_chat_refusals_name_the_field(cluster):
    for messages, words in [([], "chat.messages is empty"),
                            ([inference_pb2.ChatMessage(role="wizard", content="x")], "chat.messages[0].role")]:
        req = inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(messages=messages),
                                            sampling=inference_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as info:
            stream(cluster.router_address, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


@pytest.mark.cluster
def test_no_template_full_queue_timeout_and_no_node(model_dir, tmp_path):
    """A model without a chat template refuses chat (both doors); a full queue is 429; a request
    past --http-timeout-s gets 504; with no READY node, 503 (and /health says so)."""
    from concurrent.futures import ThreadPoolExecutor

    bare = make_model(tmp_path / "bare", "tiny", seed=11)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    # one request runs at a time, one more may wait
    router_args = ("--http-timeout-s", "2", "--capacity", "1", "--queue-size", "1")
    with one_node(bare, tmp_path, router_args=router_args) as cluster:
        c, model = client(cluster), model_id(cluster)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
        assert "no chat template" in info.value.message
        req = inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content="hi")]), sampling=inference_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as info:
            stream(cluster.router_address, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in info.value.details()

        running = c.completions.create(model=model, prompt="long", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(running))  # it runs: the next two wait, or are shed

        def short(_):
            try:
                return c.completions.create(model=model, prompt="short", max_tokens=2).usage.completion_tokens
            except openai.RateLimitError as e:
                return e
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(short, i) for i in range(2)]
            while not any(f.done() for f in waiting):
                time.sleep(0.05)
            running.close()  # the one that waited now runs
            outcomes = [f.result() for f in waiting]
        [shed] = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
        assert shed.status_code == 429 and "queue is full" in shed.message
        assert [o for o in outcomes if o is not shed] == [2]
        cluster.kill_node("node-0", signal.SIGSTOP)  # frozen: it never answers
        try:
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model=model, prompt="hi", max_tokens=4)
            assert info.value.status_code == 504
        finally:
            cluster.kill_node("node-0", signal.SIGCONT)
        # past the deadline mid-stream: the status is sent, so the stream ends with an error event
        events = iter(c.completions.create(model=model, prompt="hi", max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True}))
        next(events)
        cluster.kill_node("node-0", signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIError, match="took longer than the router's --http-timeout-s"):
                list(events)
        finally:
            cluster.kill_node("node-0", signal.SIGCONT)
        cluster.kill_node("node-0", signal.SIGTERM)
        cluster.nodes["node-0"].process.wait(30)
        health = cluster.http_url.removesuffix("/v1") + "/health"
        deadline = time.monotonic() + 30
        while httpx.get(health).status_code != 503:
            assert time.monotonic() < deadline, "the router still reports a READY node"
            time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=model, prompt="hi", max_tokens=4)
        assert info.value.status_code == 503 and "no READY compute node" in info.value.message


def test_kvfleet_generate_chat(cluster):
    """``kvfleet generate --chat`` sends the chat form: its answer is the OpenAI door's."""
    import subprocess
    import sys

    answer = client(cluster).chat.completions.create(model=model_id(cluster), messages=QUESTION, max_tokens=12,
                                                     temperature=0)
    out = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "--router", cluster.router_address,
                          "--api-key", "sk-gold", "--chat", "--system", QUESTION[0]["content"], "--max-tokens", "12",
                          QUESTION[1]["content"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == answer.choices[0].message.content.rstrip("\n")
    assert f"{answer.usage.prompt_tokens} prompt tokens" in out.stderr


@pytest.mark.process
def test_a_taken_http_port_is_one_line_and_exit_2(tmp_path):
    import socket
    import subprocess
    import sys

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvfleet.cli", "router", "--insecure-internal",
                              "--listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{port}",
                              "--etcd", "http://127.0.0.1:1", "--tenants", str(tenants)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot listen on 127.0.0.1:{port} for HTTP" in out.stderr


def test_a_client_that_leaves_while_sending_its_body_is_no_error(cluster):
    """Seen by hand under `kvfleet up` with cancelled clients: the body's read raised Starlette's
    ClientDisconnect, logged as "HTTP door: unexpected error" with a traceback (a way to flood the
    log). A client that leaves is the door's ClientGone: nothing to answer, nothing logged."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(cluster.http_url)
    before = cluster.router.log_tail(10_000)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-gold\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.5)
    assert client(cluster).models.list().data  # the door still answers
    time.sleep(0.5)
    new = cluster.router.log_tail(10_000)[len(before):]
    assert "unexpected error" not in new and "Traceback" not in new, new
