"""The tiers of tests/conftest.py: known tests get the markers their fixtures call for, `-m` sees
them, and no test or fixture starts a process without a marker to say so (else `make test-fast`
would quietly start clusters)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_TIERS

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"process", "cluster", "chaos"}
FAST = "not process and not cluster and not chaos"

# what starts a real process or server, written in a test module or its own helpers
STARTS = re.compile(r"\bLocalCluster\(|\bEtcdServer\(|\bReplicaProcess\(|\bPopen\(|\bService\(|\bstart_cluster\(|\bEtcdCluster\("
                    r"|[\"']-m[\"'],\s*[\"']kvfleet.cli|\[\s*sys\.executable\b")


class _Collect:
    def __init__(self) -> None:
        self.items: dict[str, set[str]] = {}

    def pytest_collection_finish(self, session) -> None:
        self.items = {item.nodeid: {m.name for m in item.iter_markers()} & TIERS for item in session.items}


def collect(*paths: str, marks: str | None = None) -> dict[str, set[str]]:
    """Node id -> tier markers of the tests in ``paths``, collected here as `pytest` would (only the
    tests ``-m marks`` keeps, when given)."""
    found = _Collect()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")]
    code = pytest.main([*args, *(["-m", marks] if marks else []), *(str(ROOT / p) for p in paths)], plugins=[found])
    assert code in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), f"collection failed: {code!r}"
    return found.items


def test_known_tests_get_the_tiers_of_their_fixtures():
    items = collect("tests/cluster/test_cluster_generate.py", "tests/block_service/test_election.py",
                    "tests/chaos/test_chaos_restarts.py", "tests/block_service/test_page_table.py",
                    "tests/cluster/test_parent_death.py")
    by_file: dict[str, list[set[str]]] = {}
    for nodeid, marks in items.items():
        by_file.setdefault(nodeid.split("::")[0].rsplit("/", 1)[-1], []).append(marks)
    assert set(by_file) == {"test_cluster_generate.py", "test_election.py", "test_chaos_restarts.py",
                            "test_page_table.py", "test_parent_death.py"}
    assert all(m == {"process", "cluster"} for m in by_file["test_cluster_generate.py"])   # a LocalCluster
    assert all(m == {"process"} for m in by_file["test_election.py"])                      # a real etcd
    assert all(m == {"process", "cluster", "chaos"} for m in by_file["test_chaos_restarts.py"])
    assert all(m == set() for m in by_file["test_page_table.py"])                          # pure
    assert all(m == {"process"} for m in by_file["test_parent_death.py"])                  # marked by hand
    smollm2 = collect("tests/cluster/test_smollm2_token_exact.py")
    assert sorted(smollm2.values(), key=len) == [set(), {"process", "cluster"}]  # by hand: cluster is processes


def test_the_fast_selection_sees_the_markers():
    """The markers are set before `-m` deselects: the fast tier keeps the pure module whole and
    drops every test of the cluster module."""
    kept = collect("tests/cluster/test_cluster_generate.py", "tests/block_service/test_page_table.py", marks=FAST)
    assert kept and all("test_page_table.py::" in nodeid for nodeid in kept)
    assert len(kept) == len(collect("tests/block_service/test_page_table.py"))


def _decorator_marks(node: ast.AST) -> set[str]:
    """Tier markers written on a function (``@pytest.mark.X``) or a module (``pytestmark = ...``)."""
    return set(re.findall(r"pytest\.mark\.(\w+)", " ".join(ast.unparse(d) for d in getattr(node, "decorator_list", []))))


def _module_marks(tree: ast.Module) -> set[str]:
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            marks |= set(re.findall(r"pytest\.mark\.(\w+)", ast.unparse(node.value)))
    return marks


def _starting_functions(tree: ast.Module, source: str) -> set[str]:
    """Module-level functions that start a process, themselves or through another one of the module."""
    lines = source.splitlines()
    bodies = {n.name: "\n".join(lines[n.body[0].lineno - 1:n.end_lineno]) for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    starting = {name for name, body in bodies.items() if STARTS.search(body)}
    while True:
        more = {name for name, body in bodies.items() if name not in starting
                and any(re.search(rf"\b{re.escape(s)}\(", body) for s in starting)}
        if not more:
            return starting
        starting |= more


def _unmarked_starters(path: Path) -> list[str]:
    """Names of the tests and fixtures of ``path`` that start a process with no tier to say so."""
    source = path.read_text()
    tree = ast.parse(source)
    module_marks = _module_marks(tree) & TIERS
    starting = _starting_functions(tree, source)
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name not in starting:
            continue
        if module_marks or _decorator_marks(node) & TIERS:
            continue
        is_fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
        if is_fixture and node.name in FIXTURE_TIERS:
            continue
        if node.name.startswith("test_") and {a.arg for a in node.args.args} & set(FIXTURE_TIERS):
            continue
        if is_fixture or node.name.startswith("test_"):
            found.append(node.name)
    return found


def test_every_test_or_fixture_that_starts_a_process_is_marked():
    """A fixture that starts one is named in FIXTURE_TIERS; a test that starts one by itself takes
    such a fixture or carries a marker."""
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len(files) > 100, "the listing sees the tests"
    unmarked = [f"{path.relative_to(ROOT)}::{name}" for path in files
                if path.name.startswith(("test_", "conftest")) and path != Path(__file__).resolve()  # its examples
                for name in _unmarked_starters(path)]
    assert not unmarked, "start processes without a tier marker (tests/conftest.py):\n" + "\n".join(unmarked)


def test_the_guard_finds_an_unmarked_starter(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def helper():\n    return LocalCluster(1)\n\n"
        "def test_direct():\n    helper()\n\n"
        "@pytest.mark.cluster\ndef test_marked():\n    helper()\n\n"
        "def test_with_fixture(start_cluster):\n    start_cluster(1)\n\n"
        "@pytest.fixture\ndef mine():\n    return EtcdServer().start()\n\n"
        "def test_pure():\n    assert 1\n")
    assert _unmarked_starters(tmp_path / "test_x.py") == ["test_direct", "mine"]
