"""Test tiers, set from the fixtures a test uses, so that ``make test-fast`` can leave out whatever
starts real processes without anyone keeping a list of paths up to date.

- ``process``: starts a real process or server (etcd, a kvfleet service or command, any Python
  interpreter in a subprocess);
- ``cluster``: starts a whole cluster (``LocalCluster``, ``kvfleet up``: several services at once);
- ``chaos``: kills or restarts processes on purpose.

A test gets a marker when any fixture in its closure (its own fixtures and the fixtures they use)
is named below; a fixture that starts processes belongs in these tables. A test that starts a
process without such a fixture carries the marker itself (``tests/test_tiers.py`` finds the ones
that don't).

On several xdist workers each worker picks its ports from a slice of its own (``KVFLEET_PORT_SLICE``,
kvfleet/cli/ports.py; its children inherit it), so two workers' clusters never pick the same port; and
with ``--dist loadscope`` (the process tier on several workers: ``-n 4 --dist loadscope -m "process or
cluster or chaos"``) the unit a worker takes is ``xdist_scope``'s, below.
"""

from __future__ import annotations

import os

import pytest

from kvfleet.cli.ports import SLICE_ENV
from kvfleet.core import tls

# fixture name -> the markers every test using it gets
FIXTURE_TIERS: dict[str, tuple[str, ...]] = {
    "etcd": ("process",),                    # a real etcd server (tests/cluster, block_service election/replicas)
    "wheel": ("process",),                   # tests/test_wheel.py: the wheel, built by pip in a subprocess
    "service": ("process",),                 # `kvfleet block-service` in a subprocess (test_block_service_process)
    "replicas": ("process",),                # block_service replicas in subprocesses (test_replicas)
    "start_cluster": ("process", "cluster"),  # tests/cluster/conftest.py: a LocalCluster per test
    "shared_cluster": ("process", "cluster"),  # tests/cluster/conftest.py: one LocalCluster per module
    "cluster": ("process", "cluster"),       # a module's LocalCluster (tests/chaos, test_openai_door)
    "up": ("process", "cluster"),            # `kvfleet up` in a subprocess (test_kvfleet_up)
    "tls_router": ("process", "cluster"),    # a second router, public doors over TLS (test_public_tls)
    "chaos_model": ("process", "cluster", "chaos"),  # tests/chaos: the cluster whose parts the tests kill
    "bed_cluster": ("process", "cluster", "chaos"),  # tests/partition: a cluster in network namespaces, links cut
}


# a cluster is processes; what kills processes started them (a marker written by hand implies these too)
IMPLY: dict[str, tuple[str, ...]] = {"process": (), "cluster": ("process",), "chaos": ("process",)}


def tiers_of(fixturenames) -> set[str]:
    """The markers a test using ``fixturenames`` (its whole closure) gets."""
    return {tier for name in fixturenames for tier in FIXTURE_TIERS.get(name, ())}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        have = {mark.name for mark in item.iter_markers()}
        tiers = tiers_of(getattr(item, "fixturenames", ())) | (have & IMPLY.keys())
        tiers |= {implied for tier in tiers for implied in IMPLY[tier]}
        for tier in sorted(tiers - have):
            item.add_marker(tier)


def pytest_configure(config: pytest.Config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and SLICE_ENV not in os.environ:  # worker "gw3" of 4 -> "3/4"
        os.environ[SLICE_ENV] = f"{int(worker.removeprefix('gw'))}/{int(count)}"


@pytest.fixture(autouse=True)
def _process_credentials_kept():
    """This process's internal TLS credentials (``kvfleet.core.tls``) as they were before each test. A test
    that sets them (a command's or a service's main run in-process, ``tls.use``) would leave them to the
    next test on its worker, whose clients without credentials of their own would then speak TLS to a
    plaintext service: seen on three workers as a handshake failing with WRONG_VERSION_NUMBER."""
    before = tls.current()
    yield
    tls.use(before)


# the partition bed's tests are one unit, one worker runs them in turn: its namespaces, links and subnet are
# named by pid (10.213.<pid % 250>: two beds at once could share a subnet in the root namespace)
PARTITION_BED = "tests/partition/"
# the benchmarks' smoke runs are two units, one per dtype default: at most two at once, as when they ran on two
# workers of their own (each is CPU-bound for a minute; more at once starve the timing of the chaos tests beside)
BENCH_SMOKE = "tests/bench/test_bench_smoke.py::test_benchmark_smoke["


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: its module (a module's cluster or etcd starts once, on
    one worker), except the partition bed's and the benchmarks' smoke runs. (Not ``--dist loadgroup``'s
    marks: pytest-xdist 3.8 drops them under pytest 9.2, pytest-dev/pytest-xdist#1386.)"""
    if nodeid.startswith(PARTITION_BED):
        return "the partition bed"
    if nodeid.startswith(BENCH_SMOKE):
        return f"benchmark smoke runs, {'float32' if nodeid.endswith('-float32]') else 'bfloat16'} default"
    return nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):  # the largest units first (--loadscope-reorder, xdist's default)
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Scopes(config, log)
