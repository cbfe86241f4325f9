"""The floors of the house, read from the source (nothing is imported: no torch, no grpc).

    kvfleet_cli, bench      the command line, local cluster, demo, benchmarks     (top)
    router                  the public door
    compute_service         the engine and the node
    kernels, block_service  attention kernels; the page table and its service
    kvfleet                 the ground: hashing, wire conventions, sampling, the allocator contract,
                            errors, tenants, tracing, membership, event loop, generated stubs

An import may only point to a lower floor or inside its own package; packages on the same floor do
not import each other. Every import counts, the lazy ones inside functions too, and the modules of
the project import one another without a cycle. The pure modules (policy, page table, parsers)
reach neither torch nor grpc, not even through what they import.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    "kvfleet": 0,
    "kernels": 1,
    "block_service": 1,
    "compute_service": 2,
    "router": 3,
    "kvfleet_cli": 4,
    "bench": 5,
}

# pure logic: neither these modules nor anything they import (inside the project) imports torch or grpc
PURE = [
    "kvfleet.allocator", "kvfleet.block_hash", "kvfleet.errors", "kvfleet.sampling", "kvfleet.tenants",
    "kvfleet.wire", "kvfleet.ids", "kvfleet.keepalive", "kvfleet.identity", "kvfleet.access", "kvfleet.certs",
    "kvfleet.tls_settings", "kvfleet.kv_rates", "kvfleet.decayed_rate",
    "compute_service.engine.prefill_rate", "compute_service.node.fetch_policy", "compute_service.node.fetch_figures",
    "kvfleet.roles", "router.disagg",
    "block_service.page_table", "block_service.block_pool", "block_service.local_allocator",
    "block_service.durable", "block_service.checkpoint", "block_service.trace", "block_service.tenants",
    "block_service.bookkeeping", "block_service.node_sync", "block_service.blocks_report",
    "block_service.backup", "block_service.restore", "block_service.validation", "block_service.node_pool",
    "block_service.prefix_index", "block_service.eviction", "block_service.eviction.policy",
    "block_service.eviction.lru", "block_service.eviction.facts", "block_service.fleet", "block_service.sequence",
    "block_service.node_figures", "block_service.recovery", "kvfleet.block_size",
    "block_service.pool_codec", "block_service.frozen_keys",
    "block_service.lineage", "block_service.lower_tiers", "block_service.replication_log",
    "block_service.standby_acks", "block_service.role",
    "compute_service.engine.scheduler", "compute_service.kv.cache_manager", "compute_service.blocks.allocator_policy",
    "compute_service.blocks.recent_commits", "compute_service.blocks.early_grants", "compute_service.engine.stats",
    "compute_service.blocks.write_behind", "compute_service.engine.request_phases", "kvfleet.latency_histogram",
    "compute_service.blocks.link", "compute_service.blocks.sync", "compute_service.model.sliding_window", "kvfleet.backoff",
    "compute_service.model.config", "compute_service.model.rope_config", "compute_service.model.architectures",
    "compute_service.model.checkpoint_layout", "compute_service.kv.cache_dtype",
    "compute_service.kv.layout", "compute_service.engine.batch_controller", "compute_service.engine.live_cap",
    "compute_service.kv.block_usage", "compute_service.kv.snapshot", "compute_service.blocks.tier_queue",
    "compute_service.kv.tier_index", "compute_service.engine.swap_cost", "compute_service.kv.tier_flags",
    "router.tenants", "router.stall_watch", "router.priority_queue", "router.routing", "router.request",
    "router.admission", "router.resume", "router.recent_routes", "router.running_ids",
    "router.chat_template", "router.openai_requests", "router.openai_responses",
    "compute_service.engine.cpu_host", "compute_service.node.mem_probe",
    "kvfleet_cli.supervisor", "kvfleet_cli.gguf_tokenizer", "kvfleet_cli.convert_gguf", "kvfleet_cli.models_pull",
    "kvfleet_cli.cluster_state", "kvfleet.preflight",
    "kvfleet.metric_families", "kvfleet.metrics_server", "block_service.metrics", "compute_service.node.metrics",
    "router.metrics",
    "kvfleet_cli.planning.shapes", "kvfleet_cli.planning.devices", "kvfleet_cli.planning.capacity",
    "kvfleet_cli.planning.sizing", "kvfleet_cli.planning.plan", "kvfleet_cli.planning.render",
    "kvfleet_cli.planning.model_dir", "kvfleet_cli.planning.cpu_device", "kvfleet_cli.plan_command",
    "kvfleet_cli.loadgen.workload", "kvfleet_cli.loadgen.records", "kvfleet_cli.loadgen.analysis",
    "kvfleet_cli.loadgen.search", "kvfleet_cli.loadgen.server_side", "kvfleet_cli.loadgen.plots",
    "kvfleet_cli.loadgen.progress", "kvfleet_cli.config_file",
    "kvfleet.settings", "compute_service.engine.config", "compute_service.kv.block_size",
    "compute_service.node.settings", "router.settings", "block_service.settings", "kvfleet_cli.local_nodes",
    "kvfleet_cli.demo_tenants",
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
    for package in FLOORS:
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


def floor_of(module: str) -> tuple[str, int]:
    package = module.split(".")[0]
    return package, FLOORS[package]


def test_every_package_has_a_floor():
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top_level <= set(FLOORS), f"packages without a floor: {sorted(top_level - set(FLOORS))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    package, floor = floor_of(module)
    wrong = []
    for line, imported in imports_of(MODULES[module]):
        target_package = imported.split(".")[0]
        if target_package not in FLOORS or target_package == package:
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
    assert "kvfleet.allocator" in graph["compute_service.kv.cache_manager"]
    assert "compute_service.engine.llm_engine" in graph["kvfleet_cli.demo"]
    assert any(m.startswith("block_service.") for m in graph["compute_service.blocks.registration"])
