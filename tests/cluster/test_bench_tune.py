"""``kvfleet bench`` and ``kvfleet tune`` end to end on the tiny test model, as a user runs them
(subprocesses): the files are there, and the bench's counts are the servers' own (the router's
Prometheus counters, block_service's blocks); bad input gets one line and a non-zero exit."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.cli.cli import parse_args
from kvfleet.cli.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
MAX_TOKENS = 4


def kvfleet(*argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVFLEET_STATE_FILE": str(cwd / "cluster.json")}
    env.pop("KVFLEET_ROUTER", None)
    env.pop("KVFLEET_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "kvfleet.cli", "--log-level", "ERROR", *argv], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.cluster
def test_bench_local_three_phases_agree_with_the_servers_counters(model_dir, tmp_path):
    out = tmp_path / "out"
    done = kvfleet("bench", "--local", "--model", str(model_dir), "--context", "40", "--mix", "0.5:20,0.5:70",
                   "--max-tokens", str(MAX_TOKENS), "--max-concurrency", "2", "--requests-per-client", "2",
                   "--requests", "6", "--duration", "2", "--sample-every", "0.2", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    for name in summary["files"]:
        assert (out / name).stat().st_size > 0
    for png in ("fixed_throughput_p99.png", "latency_cdf.png", "kv_usage.png"):
        assert (out / png).read_bytes().startswith(PNG)
    assert set(summary["phases"]) == {"fixed", "mixed", "soak"}

    rows = list(csv.DictReader((out / "requests.csv").open()))
    ok = [r for r in rows if r["status"] == "OK"]
    assert len(rows) == sum(p["requests"] for p in summary["phases"].values())
    assert len(ok) == len(rows)  # nothing refused on an idle cluster
    # the router's own counters moved by exactly what the client saw finish
    router, client = summary["router_counters"], summary["client_totals"]
    assert router["requests_finished"] == client["requests_finished"] == len(ok)
    assert router["generation_tokens"] == client["generation_tokens"] == MAX_TOKENS * len(ok)
    assert router["prompt_tokens"] == sum(int(r["prompt_tokens"]) for r in ok)
    # prompt lengths are the served model's tokens: the router counted what was sent
    assert all(r["usage_prompt_tokens"] == r["prompt_tokens"] for r in ok)
    assert {int(r["prompt_tokens"]) for r in rows if r["phase"] == "fixed"} == {40}
    assert {int(r["prompt_tokens"]) for r in rows if r["phase"] != "fixed"} <= {20, 70}

    fixed = summary["phases"]["fixed"]
    assert [s["concurrency"] for s in fixed["steps"]][0] == 1 and fixed["stop_reason"]
    assert fixed["steps"][0]["requests"] == 2
    kv = summary["kv_usage"]
    assert 0 < kv["peak_blocks_used"] <= kv["blocks_total"]
    assert kv["blocks_used_at_end"] == 0  # every request's blocks went back to block_service
    soak = summary["phases"]["soak"]
    series = {d["series"] for d in soak["drift"]}
    assert "blocks in use" in series and {"RSS MiB router", "RSS MiB node-0"} <= series
    assert summary["notes"] == []


def test_bench_remote_wrong_key_and_down_router(start_cluster, tmp_path):
    cluster = start_cluster(1)
    line = one_line(kvfleet("bench", "--router", cluster.router_address, "--api-key", "sk-nobody",
                            "--out", str(tmp_path / "o1"), cwd=tmp_path))
    assert line.startswith(f"kvfleet bench: the router at {cluster.router_address} refuses the API key")

    out = tmp_path / "remote"
    done = kvfleet("bench", "--router", cluster.router_address, "--api-key", "sk-gold", "--phases", "mixed",
                   "--mix", "1:30", "--max-tokens", "3", "--requests", "3", "--concurrency", "2",
                   "--block-service", cluster.block_service_address, "--certs", str(cluster.certs.root / "admin"),
                   "--out", str(out), cwd=tmp_path)  # block_service answers the cluster's admin only
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["mixed"]["completed"] == 3
    assert summary["kv_usage"]["blocks_total"] > 0
    assert any("process memory not sampled" in n for n in summary["notes"])  # remote: said, not faked
    cluster.stop()

    line = one_line(kvfleet("bench", "--router", cluster.router_address, "--api-key", "sk-gold",
                            "--out", str(tmp_path / "o2"), cwd=tmp_path))
    assert line.startswith(f"kvfleet bench: no router answers at {cluster.router_address}")


@pytest.mark.process
def test_bench_bad_input_lines(model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line(kvfleet("bench", "--router", f"127.0.0.1:{free_port()}", "--out", str(blocker / "out"),
                            cwd=tmp_path))
    assert line.startswith(f"kvfleet bench: cannot create the output directory {blocker / 'out'}")
    line = one_line(kvfleet("bench", "--local", "--model", str(model_dir), "--context", "1m", "--out",
                            str(tmp_path / "o"), cwd=tmp_path))
    assert "exceeds the model's" in line and "--scale" in line
    assert "--phases" in one_line(kvfleet("bench", "--phases", "fixed,warp", cwd=tmp_path))
    assert "no config.json" in one_line(kvfleet("bench", "--local", "--model", str(tmp_path), cwd=tmp_path))


@pytest.mark.cluster
def test_tune_two_candidates_writes_a_config_that_up_accepts(model_dir, tmp_path):
    out = tmp_path / "tune"
    done = kvfleet("tune", "--model", str(model_dir), "--slo-ms", "10000", "--block-sizes", "64,128",
                   "--confirm", "0", "--mix", "1:40", "--max-tokens", "3", "--concurrency", "2", "--requests", "4",
                   "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    for name in summary["files"]:
        assert (out / name).stat().st_size > 0
    assert (out / "tune.png").read_bytes().startswith(PNG)
    assert summary["search_order"] == [64, 128]
    assert summary["baseline"]["block_size"] == 16
    assert all(r["completed"] == r["requests"] == 4 for c in summary["candidates"] for r in c["runs"])
    winner = summary["winner"]
    assert winner["block_size"] in (64, 128) and winner["within_slo"]
    assert winner["tokens_per_s"] == max(c["tokens_per_s"] for c in summary["candidates"])
    assert f"| {winner['block_size']} **winner** |" in (out / "report.md").read_text()

    args = parse_args(["up", "--config", str(out / summary["config_file"])])
    assert (args.block_size, args.model, args.nodes) == (winner["block_size"], str(model_dir), 1)
