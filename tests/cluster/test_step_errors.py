"""An engine step that raises, in a real node process behind a real router: every request in it ends
with the exception's one-line summary (INTERNAL through the gRPC door, 500 through the OpenAI door,
``kvfleet generate`` printing it and exiting non-zero), the node logs one ERROR with the traceback and
counts it, stays up and serves the next request.

The fault is real code raising inside a real step: a ``sitecustomize`` on the node's PYTHONPATH wraps
``ModelRunner.execute`` so that it raises the error a shadowed kernels package raised
(``AttributeError``) while a switch file exists.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import openai
import pytest

from kvfleet.cli.local_cluster import LocalCluster
from tests.cluster.cluster_helpers import BLOCK_SIZE, TENANTS, random_prompt, request, stream
from tests.cluster.test_cluster_metrics import scrape

FAULT = "module 'kernels' has no attribute 'paged_prefill'"

SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, os, sys

TARGET = "kvfleet.compute_service.engine.model_runner"
SWITCH = os.environ["KVFLEET_TEST_STEP_FAULT"]


class WrapModelRunner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            execute = module.ModelRunner.execute

            def faulty(self, *args, **kwargs):
                if os.path.exists(SWITCH):
                    raise AttributeError(%r)
                return execute(self, *args, **kwargs)

            module.ModelRunner.execute = faulty

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, WrapModelRunner())
''' % FAULT


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step-errors")
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    tenants = tmp / "tenants.yaml"
    tenants.write_text(TENANTS)
    switch = tmp / "fault-on"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "hook"), os.environ.get("PYTHONPATH")])),
           "KVFLEET_TEST_STEP_FAULT": str(switch)}
    with LocalCluster(model_dir, 1, tenants_file=tenants, work_dir=tmp / "cluster", block_size=BLOCK_SIZE,
                      kv_cache_memory=16 << 20, dtype="float32", env=env) as started:
        started.fault_switch = switch
        yield started


def failing(cluster):
    """The switch on for a ``with`` block."""
    class Switch:
        def __enter__(self):
            cluster.fault_switch.touch()

        def __exit__(self, *exc):
            cluster.fault_switch.unlink()
    return Switch()


def test_a_raising_step_reaches_both_doors_as_its_error_and_the_node_serves_on(cluster):
    prompt = random_prompt(40, seed=5)
    expected = [t for c in stream(cluster.router_address, request(tokens=prompt, max_tokens=6, ignore_eos=True))
                for t in c.token_ids]
    with failing(cluster):
        with pytest.raises(grpc.RpcError) as info:
            stream(cluster.router_address, request(tokens=prompt, max_tokens=6, ignore_eos=True))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert f"AttributeError: {FAULT}" in info.value.details() and "node-0" in info.value.details()

        http = openai.OpenAI(base_url=cluster.http_url, api_key="sk-gold", max_retries=0, timeout=120)
        model = http.models.list().data[0].id
        with pytest.raises(openai.InternalServerError) as answer:
            http.completions.create(model=model, prompt="Hello there", max_tokens=4)
        assert answer.value.status_code == 500 and FAULT in str(answer.value)

        done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "--router", cluster.router_address,
                               "--api-key", "sk-gold", "--max-tokens", "3", "hi"], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: INTERNAL:") and FAULT in last and "Traceback" not in done.stderr

    # the node is the same process, serving the same tokens
    assert cluster.child("node-0").alive()
    again = [t for c in stream(cluster.router_address, request(tokens=prompt, max_tokens=6, ignore_eos=True))
             for t in c.token_ids]
    assert again == expected

    samples = scrape(cluster.metrics_urls["node-0"])
    failures = [v for (name, _), v in samples.items() if name == "kvfleet:engine_step_failures_total"]
    assert failures == [3.0], failures
    log = cluster.child("node-0").log_path.read_text(errors="replace")
    errors = [line for line in log.splitlines() if " ERROR " in line and "engine step failed" in line]
    assert len(errors) == 3, errors
    assert log.count("Traceback (most recent call last)") >= 3 and f"AttributeError: {FAULT}" in log


def test_the_in_process_demo_prints_the_error_and_exits_non_zero(cluster, model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cluster.fault_switch.parent / "hook"),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "KVFLEET_TEST_STEP_FAULT": str(cluster.fault_switch)}
    with failing(cluster):
        done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "demo", "--in-process", "--model", str(model_dir),
                               "--max-tokens", "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvfleet demo: 4 of 4 requests failed: engine step failed on node local: AttributeError"), last
    assert done.stdout.count("-- failed: engine step failed") == 4, done.stdout
