"""The partition bed's namespaces and faults, on their own (no kvfleet service): services reach each
other over the bridge, a cut drops both ways, a one-way cut only one, loss drops a share, a delay
(netem or the delay proxy) holds each round trip at least its configured minimum, the heal restores
all; and the bed is gone afterwards even when the code inside failed, its processes too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from kvfleet.cli.partition import netns

pytestmark = pytest.mark.process  # processes run inside the namespaces

RECEIVE = ("import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind((sys.argv[1],9000)); "
           "print('bound',flush=True); sys.stdin.readline(); s.settimeout(float(sys.argv[2]));\n"
           "try: print(len([s.recv(64) for _ in range(int(sys.argv[3]))]))\n"
           "except TimeoutError: print('timeout')")
SEND = ("import socket,sys,time,contextlib; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); time.sleep(0.3)\n"
        "for _ in range(int(sys.argv[2])):\n with contextlib.suppress(OSError): s.sendto(b'x',(sys.argv[1],9000))")
# (a DROP in OUTPUT answers the sender EPERM: dropped all the same)


@pytest.fixture(autouse=True)
def _need_namespaces():
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(f"no partition bed here: {reason}")


def datagrams(bed: netns.Netbed, src: str, dst: str, count: int = 1, wait_s: float = 1.5) -> str:
    """How many of ``count`` UDP datagrams from ``src`` reached ``dst`` ('timeout': fewer within ``wait_s``
    of the last one sent; the receiver's interpreter start-up, slow on a loaded machine, not counted)."""
    receiver = subprocess.Popen([*bed.exec_prefix(dst), sys.executable, "-c", RECEIVE, bed.ip[dst], str(wait_s),
                                 str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "bound"
    subprocess.run([*bed.exec_prefix(src), sys.executable, "-c", SEND, bed.ip[dst], str(count)], check=True)
    return receiver.communicate("sent\n", timeout=30)[0].strip()  # its wait starts once all were sent


def test_cuts_one_way_cuts_and_the_heal():
    with netns.Netbed(["a", "b"]) as bed:
        assert datagrams(bed, "a", "b") == "1" and datagrams(bed, "b", "a") == "1"
        bed.cut("a", "b", one_way=True)
        assert datagrams(bed, "a", "b") == "timeout" and datagrams(bed, "b", "a") == "1"
        bed.heal()
        bed.cut("a", "b")
        assert datagrams(bed, "a", "b") == "timeout" and datagrams(bed, "b", "a") == "timeout"
        bed.heal()
        assert datagrams(bed, "a", "b") == "1"
        bed.loss("a", "b", 100.0)
        assert datagrams(bed, "a", "b") == "timeout"
        assert bed.faults == ["cut a -> b", "heal", "cut a <-> b", "heal", "loss a -> b 100.0%"]


def _ours() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(netns.PREFIX)]


def test_the_bed_and_its_processes_are_gone_after_a_failure():
    with pytest.raises(RuntimeError, match="the test failed"), netns.Netbed(["a"]) as bed:
        sleeper = subprocess.Popen([*bed.exec_prefix("a"), "sleep", "600"])
        assert _ours()
        raise RuntimeError("the test failed")
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    assert not [n for n in _ours() if n.startswith(bed.tag)]


def test_sweep_removes_what_a_dead_run_left():
    left = f"{netns.PREFIX}4999999-x"  # no process has that id (above the largest pid_max, 2**22)
    subprocess.run(["ip", "netns", "add", left], check=True)
    try:
        assert left in netns.sweep()
        assert left not in _ours()
    finally:
        subprocess.run(["ip", "netns", "del", left], capture_output=True)


ECHO = ("import socket,sys,threading; s=socket.create_server((sys.argv[1],9001)); print('up',flush=True)\n"
        "def serve(c):\n while d:=c.recv(64): c.sendall(d)\n c.close()\n"
        "while True: threading.Thread(target=serve,args=(s.accept()[0],),daemon=True).start()")
PING = ("import socket,sys,time,json; c=socket.create_connection((sys.argv[1],9001),timeout=30); rtts=[]\n"
        "for _ in range(int(sys.argv[2])):\n t=time.monotonic(); c.sendall(b'p'); assert c.recv(1)==b'p'; "
        "rtts.append(time.monotonic()-t)\nc.close(); print(json.dumps(rtts))")


def round_trips(bed: netns.Netbed, src: str, dst: str, count: int = 5) -> list[float]:
    """Seconds of ``count`` one-byte TCP round trips from ``src`` to an echo in ``dst``."""
    done = subprocess.run([*bed.exec_prefix(src), sys.executable, "-c", PING, bed.ip[dst], str(count)],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_delay_delays_each_way_and_the_heal_removes_it():
    with netns.Netbed(["a", "b"]) as bed:
        echo = subprocess.Popen([*bed.exec_prefix("b"), sys.executable, "-c", ECHO, bed.ip["b"]],
                                stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "up"
        bed.delay("a", 200, 100)
        bed.delay("b", 200, 100)
        proxies = list(bed.proxies.values())
        rtts = round_trips(bed, "a", "b")
        # a's request and b's reply, each delayed 200 ± 100 ms: no round trip under 2 × 100 ms
        assert len(rtts) == 5 and min(rtts) >= 2 * (0.200 - 0.100), rtts
        held = socket.create_connection((bed.ip["b"], 9001), timeout=30)  # from the root namespace: dialled in
        began = time.monotonic()
        held.sendall(b"q")
        assert held.recv(1) == b"q" and time.monotonic() - began >= 0.200 - 0.100  # b's reply delayed
        bed.heal()
        held.sendall(b"r")
        assert held.recv(1) == b"r"  # a connection carried through the fault outlives the heal
        held.close()
        assert bed.faults == ["delay a 200ms 100ms", "delay b 200ms 100ms", "heal"]
        for name in ("a", "b"):
            nat = subprocess.run([*bed.exec_prefix(name), "iptables", "-t", "nat", "-S"], capture_output=True,
                                 text=True, check=True).stdout
            qdisc = subprocess.run([*bed.exec_prefix(name), "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, check=True).stdout
            assert "REDIRECT" not in nat and "netem" not in qdisc, (nat, qdisc)
        assert not bed.proxies
        for proxy in proxies:  # the ping's connection has closed: the drained proxies have exited
            assert proxy.wait(timeout=30) == 0
        assert len(round_trips(bed, "a", "b", count=3)) == 3  # and the link works, undelayed
        echo.kill()
        echo.wait()
