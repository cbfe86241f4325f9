"""Network namespaces for the partition test bed: one namespace per service, all on one bridge, and
faults per link (Linux, as root: ``ip netns``, veth pairs, ``iptables``; ``tc netem`` where the kernel has it).

    root ns (the clients, 10.213.N.1) ── veth ──┐
    <prefix>-hub: bridge ───────────────────────┼── veth ── <prefix>-etcd     10.213.N.2
                                                ├── veth ── <prefix>-bs-a     10.213.N.3 ...

The bridge lives in a hub namespace of its own, so the host's firewall (a ``FORWARD DROP`` policy,
``br_netfilter``) never sees the bed's traffic and nothing in the root namespace's tables changes.
Every name starts with ``kvp<pid>``: ``sweep()`` removes what a dead run left behind, and ``close()``
(also at exit, and on leaving the ``with``) removes this run's namespaces, links and processes.

Faults, each inside a service's own namespace: ``cut(a, b)`` drops a's packets to b and b's to a
(``one_way=True``: only a → b); ``loss(a, b, pct)`` drops a share of a's packets at random (iptables
``statistic``); ``delay(a, ms, jitter)`` delays what a sends: its packets (``tc netem``) where the
kernel has ``sch_netem``, else its TCP bytes (``delay_proxy``: iptables ``nat`` rules hand every bed
connection that a's ``eth0`` carries, dialled out or in, to a proxy in a's namespace that delays the
bytes a sends); ``heal()`` removes every fault (the proxies stop accepting and stop delaying, and
exit once the connections they carry close).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterable, Sequence

from kvfleet.cli.partition import delay_proxy
from kvfleet.core import parent_death

PREFIX = "kvp"
SUBNET = "10.213"
PROXY_PORT = 15999  # the delay proxy's, in each delayed namespace (no service listens there)


class BedUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``iptables``/``tc``); one line."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def why_unavailable() -> str | None:
    """Why a bed cannot be made on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    missing = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    try:
        if _run("ip", "netns", "exec", probe, "iptables", "-S", check=False).returncode != 0:
            return "iptables does not work inside a network namespace here"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@functools.cache
def has_netem() -> bool:
    """Whether this kernel delays packets (``tc netem``; some VMs' kernels have no ``sch_netem``)."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        return _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False).returncode == 0
    finally:
        _run("ip", "netns", "del", probe, check=False)


def delay_mechanism() -> str:
    """How ``Netbed.delay`` delays here: ``"netem"`` (packets) or ``"proxy"`` (TCP bytes, ``delay_proxy``)."""
    return "netem" if has_netem() else "proxy"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    digits = name[len(PREFIX):].split("-", 1)[0].rstrip("hrb")
    digits = "".join(ch for ch in digits if ch.isdigit())
    return int(digits) if name.startswith(PREFIX) and digits else None


def sweep() -> list[str]:
    """Remove the namespaces (and their processes) that a dead run of the bed left behind."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = _owner(name)
        if owner is not None and owner != os.getpid() and not _pid_alive(owner):
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_inside(namespace: str) -> None:
    for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Netbed:
    """``with Netbed(["etcd", "bs-a", ...]) as bed:`` — each name gets a namespace and an address
    (``bed.ip[name]``); ``bed.exec_prefix(name)`` runs a command inside; ``bed.client_ip`` is the
    root namespace's address on the bridge."""

    def __init__(self, services: Iterable[str]) -> None:
        self.services = list(services)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = f"{SUBNET}.{os.getpid() % 250}"
        self.hub = f"{self.tag}-hub"
        self.ns = {name: f"{self.tag}-{name}" for name in self.services}
        self.ip = {name: f"{self.subnet}.{i + 2}" for i, name in enumerate(self.services)}
        self.client_ip = f"{self.subnet}.1"
        self.faults: list[str] = []  # each fault, in words, in the order injected
        self.proxies: dict[str, subprocess.Popen] = {}  # service -> its delay proxy, accepting
        self._draining: list[subprocess.Popen] = []     # healed proxies, carrying their last connections
        self._tracking: set[str] = set()                # services whose conntrack a rule keeps on
        self._open = False

    # -- making and removing ----------------------------------------------------------------------

    def open(self) -> Netbed:
        reason = why_unavailable()
        if reason:
            raise BedUnavailable(reason)
        sweep()
        atexit.register(self.close)
        self._open = True
        try:
            _run("ip", "netns", "add", self.hub)
            self._hub("ip", "link", "add", "br0", "type", "bridge")
            self._hub("ip", "link", "set", "br0", "up")
            self._link("r", None, self.client_ip)
            for i, name in enumerate(self.services):
                _run("ip", "netns", "add", self.ns[name])
                self._link(str(i), self.ns[name], self.ip[name])
        except BaseException:
            self.close()
            raise
        return self

    def _hub(self, *argv: str) -> None:
        _run("ip", "netns", "exec", self.hub, *argv)

    def _link(self, key: str, namespace: str | None, address: str) -> None:
        """A veth pair: one end on the hub's bridge, the other in ``namespace`` (None: the root one)
        as ``eth0`` with ``address``."""
        outer, inner = f"{self.tag}h{key}", f"{self.tag}i{key}"
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", outer, "netns", self.hub)
        self._hub("ip", "link", "set", outer, "master", "br0")
        self._hub("ip", "link", "set", outer, "up")
        if namespace is None:
            _run("ip", "addr", "add", f"{address}/24", "dev", inner)
            _run("ip", "link", "set", inner, "up")
            return
        _run("ip", "link", "set", inner, "netns", namespace)
        inside = ["ip", "netns", "exec", namespace]
        _run(*inside, "ip", "link", "set", inner, "name", "eth0")
        _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill whatever runs inside the bed, remove its namespaces and links; safe to call twice."""
        if not self._open:
            return
        self._open = False
        for proxy in [*self.proxies.values(), *self._draining]:
            proxy.kill()
        for namespace in [*self.ns.values(), self.hub]:
            _kill_inside(namespace)
            _run("ip", "netns", "del", namespace, check=False)
        _run("ip", "link", "del", f"{self.tag}ir", check=False)  # gone with the hub's end, normally
        for proxy in [*self.proxies.values(), *self._draining]:
            proxy.wait()
            proxy.stdout.close()
        self.proxies, self._draining = {}, []
        atexit.unregister(self.close)

    def __enter__(self) -> Netbed:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running inside ---------------------------------------------------------------------------

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns[name]]

    def _in(self, name: str, *argv: str) -> None:
        _run(*self.exec_prefix(name), *argv)

    # -- faults -----------------------------------------------------------------------------------

    def cut(self, a: str, b: str, one_way: bool = False) -> None:
        """Drop a's packets to b; and b's to a unless ``one_way``. ``b`` may be ``"client"``."""
        dst = self.client_ip if b == "client" else self.ip[b]
        self._in(a, "iptables", "-A", "OUTPUT", "-d", dst, "-j", "DROP")
        if not one_way:
            self._in(a, "iptables", "-A", "INPUT", "-s", dst, "-j", "DROP")
        self.faults.append(f"cut {a} {'->' if one_way else '<->'} {b}")

    def isolate(self, a: str, *others: str) -> None:
        """Cut ``a`` from each of ``others`` both ways."""
        for b in others:
            self.cut(a, b)

    def loss(self, a: str, b: str | None = None, pct: float = 10.0) -> None:
        """Drop ``pct`` % of a's packets out of ``eth0`` (to ``b`` only when given), at random (iptables;
        not on ``lo``, where a delay proxy's legs run)."""
        dst = [] if b is None else ["-d", self.client_ip if b == "client" else self.ip[b]]
        self._in(a, "iptables", "-A", "OUTPUT", "-o", "eth0", *dst, "-m", "statistic", "--mode", "random",
                 "--probability", f"{pct / 100:.4f}", "-j", "DROP")
        self.faults.append(f"loss {a}{'' if b is None else ' -> ' + b} {pct}%")

    def delay(self, a: str, delay_ms: int, jitter_ms: int = 0) -> None:
        """Delay what a sends by ``delay_ms`` ± ``jitter_ms``: its packets (``tc netem``) where the kernel
        has netem, else the bytes of its TCP connections in the bed (``delay_proxy``; UDP undelayed)."""
        self.delay_every([a], delay_ms, jitter_ms)

    def delay_every(self, names: Sequence[str], delay_ms: int, jitter_ms: int = 0) -> None:
        """``delay`` for each of ``names`` at one moment: with the proxy, every proxy is started and
        accepting before any namespace's rules go in. One namespace after another, each proxy's
        start (a Python start-up) spread the onset over seconds, and a connection made again between
        two namespaces' rules was reset again by the next ones (the lossy soak's leader, its etcd
        connection reset twice, fenced)."""
        if delay_mechanism() == "netem":
            spec = ["netem", "delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
            for a in names:
                done = _run(*self.exec_prefix(a), "tc", "qdisc", "replace", "dev", "eth0", "root", *spec, check=False)
                if done.returncode != 0:
                    raise BedUnavailable(f"tc netem: {done.stderr.strip()}")
        else:
            launched = [(a, self._launch_proxy(a, delay_ms, jitter_ms)) for a in names]
            for a, proxy in launched:
                self._await_listening(a, proxy)
            for a in names:
                self._redirect(a)
        self.faults += [f"delay {a} {delay_ms}ms" + (f" {jitter_ms}ms" if jitter_ms else "") for a in names]

    def _launch_proxy(self, a: str, delay_ms: int, jitter_ms: int) -> subprocess.Popen:
        """A delay proxy started in a's namespace (not yet accepting: ``_await_listening``)."""
        self._stop_proxy(a)
        seed = zlib.crc32(f"{a}:{len(self.faults)}".encode())
        argv = [sys.executable, "-m", "kvfleet.cli.partition.delay_proxy", "--listen", str(PROXY_PORT),
                "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), "--seed", str(seed)]
        return subprocess.Popen([*self.exec_prefix(a), *argv], stdout=subprocess.PIPE, text=True,
                                env=parent_death.child_env(os.environ), start_new_session=True)

    def _await_listening(self, a: str, proxy: subprocess.Popen) -> None:
        if proxy.stdout.readline().strip() != "listening":
            proxy.kill()
            proxy.wait()
            proxy.stdout.close()
            raise BedUnavailable(f"the delay proxy in {a} did not start (exit {proxy.returncode})")
        self.proxies[a] = proxy

    def _redirect(self, a: str) -> None:
        """The rules that hand a's connections to its proxy (accepting by now)."""
        if a not in self._tracking:  # conntrack kept on for good: see _stop_proxy
            self._in(a, "iptables", "-t", "mangle", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "INVALID",
                     "-j", "RETURN")
            self._tracking.add(a)
        for rule in delay_proxy.redirect_rules(f"{self.subnet}.0/24", PROXY_PORT):
            self._in(a, "iptables", "-t", "nat", "-A", *rule)

    def _stop_proxy(self, a: str) -> None:
        """a's redirection removed and its proxy told to drain (it answers once it no longer accepts)."""
        proxy = self.proxies.pop(a, None)
        if proxy is None:
            return
        for rule in delay_proxy.redirect_rules(f"{self.subnet}.0/24", PROXY_PORT):
            # the mangle rule's conntrack match (never removed) keeps conntrack on in the namespace: were
            # the REDIRECT rules its last users, the carried connections would lose their translation
            self._in(a, "iptables", "-t", "nat", "-D", *rule)
        proxy.terminate()
        proxy.stdout.readline()  # "draining" (or "" where it has died)
        self._draining.append(proxy)
        for done in [p for p in self._draining if p.poll() is not None]:
            done.stdout.close()
            self._draining.remove(done)

    def heal(self) -> None:
        """Remove every cut, loss and delay of the bed."""
        if not self.faults or self.faults[-1] == "heal":
            return
        for name in self.services:
            self._in(name, "iptables", "-F")
            self._stop_proxy(name)
            _run(*self.exec_prefix(name), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self.faults.append("heal")
