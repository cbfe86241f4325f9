"""The router's public doors over TLS (``--tls-cert``/``--tls-key``): a second router beside the
module's cluster serves its gRPC and HTTP doors with a certificate; a client that trusts it gets
tokens, a plaintext client gets nothing, and the API key is still what admits a tenant."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import grpc
import httpx2 as httpx
import pytest
from cluster_helpers import TENANTS, random_prompt, request, tokens_of
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.cli.ports import free_port
from kvfleet.core import certs
from kvfleet.core.identity import ROUTER_ID
from kvfleet.v1 import inference_pb2_grpc


@pytest.fixture(scope="module")
def tls_router(shared_cluster, tmp_path_factory):
    cluster = shared_cluster(1)
    tmp = tmp_path_factory.mktemp("public-tls")
    tenants = tmp / "tenants.yaml"
    tenants.write_text(TENANTS)
    own = certs.identity_dir(cluster.certs.root, ROUTER_ID)  # its certificate names 127.0.0.1 too
    grpc_port, http_port = free_port(), free_port()
    log = open(tmp / "router.log", "wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "router", "--listen", f"127.0.0.1:{grpc_port}",
         "--http-listen", f"127.0.0.1:{http_port}", "--etcd", cluster.etcd.url, "--tenants", str(tenants),
         "--model", cluster.model_dir, "--block-service", cluster.block_service_address, "--certs", str(own),
         "--tls-cert", str(own / certs.CERT_FILE), "--tls-key", str(own / certs.KEY_FILE)],
        stdout=log, stderr=subprocess.STDOUT)
    ca = (own / certs.CA_FILE).read_bytes()
    try:
        _wait_serving(f"127.0.0.1:{grpc_port}", ca, router, tmp / "router.log")
        yield f"127.0.0.1:{grpc_port}", f"https://127.0.0.1:{http_port}/v1", ca, own / certs.CA_FILE, tmp / "router.log"
    finally:
        router.terminate()
        router.wait(30)
        log.close()


def _wait_serving(address: str, ca: bytes, router: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 120
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert router.poll() is None, log_path.read_text()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="kvfleet.v1.Inference"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"the TLS router never served:\n{log_path.read_text()[-3000:]}")


def test_the_grpc_door_over_tls_serves_a_client_that_trusts_it_and_no_plaintext_one(tls_router):
    address, _, ca, _, log_path = tls_router
    req = request(tokens=random_prompt(20, 3), max_tokens=5, ignore_eos=True)
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chunks = list(stub.Generate(req, metadata=[("authorization", "Bearer sk-gold")], timeout=120))
        assert len(tokens_of(chunks)) == 5
        with pytest.raises(grpc.RpcError) as refused:  # TLS is the wire, the key still admits
            list(stub.Generate(req, metadata=[("authorization", "Bearer sk-nope")], timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as plaintext:
        with pytest.raises(grpc.RpcError) as err:
            list(inference_pb2_grpc.InferenceStub(plaintext).Generate(
                req, metadata=[("authorization", "Bearer sk-gold")], timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "over TLS" in log_path.read_text()


def test_the_http_door_over_tls(tls_router):
    _, url, _, ca_file, _ = tls_router
    trusting = ssl.create_default_context(cafile=str(ca_file))
    key = {"authorization": "Bearer sk-gold"}
    [model] = [m["id"] for m in httpx.get(url + "/models", headers=key, verify=trusting, timeout=30).json()["data"]]
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    answer = httpx.post(url + "/completions", json=body, headers=key, verify=trusting, timeout=120)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
        httpx.post(url.replace("https://", "http://") + "/completions", json=body, timeout=10)


def test_kvfleet_generate_trusts_the_door_with_tls_ca(tls_router, tmp_path):
    address, _, _, ca_file, _ = tls_router

    def generate(*extra):
        return subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "--router", address, "--api-key",
                               "sk-gold", "--max-tokens", "3", "--ignore-eos", *extra, "hi"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    done = generate("--tls-ca", str(ca_file))
    assert done.returncode == 0 and "3 generated" in done.stderr, done.stderr
    plaintext = generate()  # a plaintext client at a TLS door: nobody answers it
    assert plaintext.returncode == 1 and plaintext.stderr.strip().startswith("kvfleet generate: no router answers")
    bad = generate("--tls-ca", str(tmp_path / "missing.pem"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"kvfleet generate: --tls-ca {tmp_path / 'missing.pem'}: No such file or directory"]
