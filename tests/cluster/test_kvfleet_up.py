"""``kvfleet up`` starts the cluster, serves, and on Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster_helpers import request, stream, tokens_of

from kvfleet_cli.local_cluster import LocalCluster


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_serves_and_ctrl_c_stops_everything(model_dir, tmp_path):
    up = subprocess.Popen(
        [sys.executable, "-m", "kvfleet_cli.cli", "up", "--nodes", "2", "--model", str(model_dir),
         "--work-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    children: list[int] = []
    try:
        address = None
        deadline = time.monotonic() + 120
        lines = []
        while address is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"router at (\S+),", line)
            address = match and match.group(1)
        assert address, "".join(lines)
        children = children_of(up.pid)
        assert len(children) >= 5  # etcd, block_service, two compute nodes, router
        chunks = stream(address, request(text="hello from kvfleet up", max_tokens=5, ignore_eos=True))
        assert len(tokens_of(chunks)) == 5
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        out = up.stdout.read()
        assert "stopping the cluster" in "".join(lines) + out
        time.sleep(0.5)
        assert [p for p in children if alive(p)] == []
    finally:
        if up.poll() is None:
            up.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_temporary_cluster_keeps_its_logs_and_drops_its_state(model_dir):
    with LocalCluster(model_dir, num_nodes=1) as cluster:
        work = cluster.work_dir
        assert (work / "etcd").is_dir() and (work / "block_state").is_dir()
    try:
        assert not (work / "etcd").exists() and not (work / "block_state").exists()
        assert (work / "router.log").exists() and (work / "node-0.log").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)
