"""The floors of the house, read from the source (nothing is imported: no torch, no grpc).

    kvfleet.cli, bench                      the command line, local cluster, demo, benchmarks  (top)
    kvfleet.router                          the public door
    kvfleet.compute_service                 the engine and the node
    kvfleet.kernels, kvfleet.block_service  attention kernels; the page table and its service
    kvfleet.core, kvfleet.v1                the ground: hashing, wire conventions, sampling, the allocator
                                            contract, errors, tenants, tracing, membership, event loop;
                                            the generated stubs

Everything kvfleet ships imports as ``kvfleet.<part>``: nothing at the repository root is a package
under another name (a generic one, ``kernels`` or ``router``, would shadow a distribution of the same
name installed beside kvfleet, or be shadowed by it). An import may only point to a lower floor or
inside its own package; packages on the same floor do not import each other. Every import counts,
the lazy ones inside functions too, and the modules of the project import one another without a
cycle. The pure modules (policy, page table, parsers) reach neither torch nor grpc, not even through
what they import.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    "kvfleet": -1,                # the namespace package itself: its version, nothing else, under every floor
    "kvfleet.core": 0,
    "kvfleet.kernels": 1,
    "kvfleet.block_service": 1,
    "kvfleet.compute_service": 2,
    "kvfleet.router": 3,
    "kvfleet.cli": 4,
    "bench": 5,
}

# pure logic: neither these modules nor anything they import (inside the project) imports torch or grpc
PURE = [
    "kvfleet.core.allocator", "kvfleet.core.block_hash", "kvfleet.core.errors", "kvfleet.core.sampling",
    "kvfleet.core.tenants", "kvfleet.core.wire", "kvfleet.core.ids", "kvfleet.core.keepalive", "kvfleet.core.identity",
    "kvfleet.core.access", "kvfleet.core.certs", "kvfleet.core.tls_settings", "kvfleet.core.kv_rates",
    "kvfleet.core.decayed_rate", "kvfleet.compute_service.engine.prefill_rate",
    "kvfleet.compute_service.node.fetch_policy", "kvfleet.compute_service.node.fetch_figures", "kvfleet.core.roles",
    "kvfleet.router.disagg", "kvfleet.block_service.page_table", "kvfleet.block_service.block_pool",
    "kvfleet.block_service.local_allocator", "kvfleet.block_service.durable", "kvfleet.block_service.checkpoint",
    "kvfleet.block_service.trace", "kvfleet.block_service.tenants", "kvfleet.block_service.bookkeeping",
    "kvfleet.block_service.node_sync", "kvfleet.block_service.blocks_report", "kvfleet.block_service.backup",
    "kvfleet.block_service.restore", "kvfleet.block_service.validation", "kvfleet.block_service.node_pool",
    "kvfleet.block_service.prefix_index", "kvfleet.block_service.eviction", "kvfleet.block_service.eviction.policy",
    "kvfleet.block_service.eviction.lru", "kvfleet.block_service.eviction.facts", "kvfleet.block_service.fleet",
    "kvfleet.block_service.sequence", "kvfleet.block_service.node_figures", "kvfleet.block_service.recovery",
    "kvfleet.core.block_size", "kvfleet.block_service.pool_codec", "kvfleet.block_service.frozen_keys",
    "kvfleet.block_service.lineage", "kvfleet.block_service.lower_tiers", "kvfleet.block_service.replication_log",
    "kvfleet.block_service.standby_acks", "kvfleet.block_service.role", "kvfleet.compute_service.engine.scheduler",
    "kvfleet.compute_service.kv.cache_manager", "kvfleet.compute_service.blocks.allocator_policy",
    "kvfleet.compute_service.blocks.recent_commits", "kvfleet.compute_service.blocks.early_grants",
    "kvfleet.compute_service.engine.stats", "kvfleet.compute_service.blocks.write_behind",
    "kvfleet.compute_service.engine.request_phases", "kvfleet.core.latency_histogram",
    "kvfleet.compute_service.blocks.link", "kvfleet.compute_service.blocks.sync",
    "kvfleet.compute_service.model.sliding_window", "kvfleet.core.backoff", "kvfleet.compute_service.model.config",
    "kvfleet.compute_service.model.rope_config", "kvfleet.compute_service.model.architectures",
    "kvfleet.compute_service.model.checkpoint_layout", "kvfleet.compute_service.kv.cache_dtype",
    "kvfleet.compute_service.kv.layout", "kvfleet.compute_service.engine.batch_controller",
    "kvfleet.compute_service.engine.live_cap", "kvfleet.compute_service.kv.block_usage",
    "kvfleet.compute_service.kv.snapshot", "kvfleet.compute_service.blocks.tier_queue",
    "kvfleet.compute_service.kv.tier_index", "kvfleet.compute_service.engine.swap_cost",
    "kvfleet.compute_service.kv.tier_flags", "kvfleet.router.tenants", "kvfleet.router.stall_watch",
    "kvfleet.router.priority_queue", "kvfleet.router.routing", "kvfleet.router.request", "kvfleet.router.admission",
    "kvfleet.router.resume", "kvfleet.router.recent_routes", "kvfleet.router.running_ids",
    "kvfleet.router.chat_template", "kvfleet.router.openai_requests", "kvfleet.router.openai_responses",
    "kvfleet.compute_service.engine.cpu_host", "kvfleet.compute_service.node.mem_probe", "kvfleet.cli.supervisor",
    "kvfleet.cli.gguf_tokenizer", "kvfleet.cli.convert_gguf", "kvfleet.cli.models_pull", "kvfleet.cli.cluster_state",
    "kvfleet.core.preflight", "kvfleet.core.metric_families", "kvfleet.core.metrics_server",
    "kvfleet.block_service.metrics", "kvfleet.compute_service.node.metrics", "kvfleet.router.metrics",
    "kvfleet.cli.planning.shapes", "kvfleet.cli.planning.devices", "kvfleet.cli.planning.capacity",
    "kvfleet.cli.planning.sizing", "kvfleet.cli.planning.plan", "kvfleet.cli.planning.render",
    "kvfleet.cli.planning.model_dir", "kvfleet.cli.planning.cpu_device", "kvfleet.cli.plan_command",
    "kvfleet.cli.loadgen.workload", "kvfleet.cli.loadgen.records", "kvfleet.cli.loadgen.analysis",
    "kvfleet.cli.loadgen.search", "kvfleet.cli.loadgen.server_side", "kvfleet.cli.loadgen.plots",
    "kvfleet.cli.loadgen.progress", "kvfleet.cli.config_file", "kvfleet.core.settings",
    "kvfleet.compute_service.engine.config", "kvfleet.compute_service.kv.block_size",
    "kvfleet.compute_service.node.settings", "kvfleet.router.settings", "kvfleet.block_service.settings",
    "kvfleet.cli.local_nodes", "kvfleet.cli.demo_tenants",
]
HEAVY = ("torch", "grpc", "aetcd", "triton", "google")

# generated stubs are ground: kvfleet.v1 is the wire format every floor speaks
GENERATED = "kvfleet.v1"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in ("kvfleet", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if not name.startswith(GENERATED):
                modules[name] = path
    return modules


MODULES = project_modules()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            # `from pkg import module` names a module of the project: count it as that module
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in MODULES]
    return found


def resolve(name: str) -> str | None:
    """The project module an imported name refers to (its longest known prefix), or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return None


@cache
def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        # a module's own parent packages are loaded before it anyway: not an arrow
        ancestors = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = {m for _, imported in imports_of(path)
                       if (m := resolve(imported)) and m != name and m not in ancestors}
    return graph


def package_of(module: str) -> str | None:
    """The floor's package ``module`` belongs to (its longest prefix in FLOORS), or None."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return ".".join(parts[:i])
    return None


def floor_of(module: str) -> tuple[str, int]:
    package = package_of(module)
    return package, FLOORS[package]


def test_one_import_namespace():
    """The only package at the repository root is ``kvfleet`` (``bench`` is a folder of scripts, not
    a package: a namespace portion never shadows an installed package of the same name)."""
    top_level = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert top_level == ["kvfleet"], f"packages at the repository root besides kvfleet: {top_level}"


def test_every_package_has_a_floor():
    parts = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "kvfleet").glob("*/__init__.py")}
    missing = sorted(parts - set(FLOORS) - {GENERATED})
    assert not missing, f"packages of kvfleet without a floor: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    package, floor = floor_of(module)
    wrong = []
    for line, imported in imports_of(MODULES[module]):
        target_package = package_of(imported)
        if target_package is None or target_package == package or imported.startswith(GENERATED):
            continue
        target_floor = FLOORS[target_package]
        if target_floor >= floor:
            direction = "up" if target_floor > floor else "sideways"
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {imported} ({direction})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_reach_neither_torch_nor_grpc(module):
    assert module in MODULES, f"{module} is not a module of the project"
    seen, todo, heavy = set(), [module], []
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for line, imported in imports_of(MODULES[current]):
            if imported.split(".")[0] in HEAVY:
                heavy.append(f"{MODULES[current].relative_to(ROOT)}:{line} imports {imported}")
        todo += edges()[current]
    assert not heavy, f"{module} reaches: " + "; ".join(heavy)


def test_the_graph_sees_known_arrows():
    """The reader is not blind: arrows that exist must be found (a parser that found none would pass
    every test above)."""
    graph = edges()
    assert "kvfleet.core.allocator" in graph["kvfleet.compute_service.kv.cache_manager"]
    assert "kvfleet.compute_service.engine.llm_engine" in graph["kvfleet.cli.demo"]
    assert any(m.startswith("kvfleet.block_service.") for m in graph["kvfleet.compute_service.blocks.registration"])
