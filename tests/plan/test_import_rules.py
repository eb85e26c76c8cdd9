"""DESIGN.md's import rules, checked on the source tree (every import statement, also those inside
functions): vmalloc imports neither swap nor bench; swap reaches vmalloc only through its public names and
never imports bench; nothing outside bench/ and tests/ imports bench; no import cycles among the project's
modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vmalloc", "swap", "bench")
SCANNED = ("vmalloc", "swap", "bench", "examples")

# Known breaks of a rule, each with who is to remove it; the test fails on any other.
KNOWN = {
    # The swap runtime finds vmalloc's global arena through the extension module, which has no public
    # name for it yet (swap/runtime/memory.py and vmalloc's exports belong to the torch-facing work).
    ("swap.runtime.memory", "vmalloc._C"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


EXTENSIONS = {"vmalloc._C"}  # compiled modules (setup.py), present or not in this checkout


def sources() -> dict[str, Path]:
    out = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[module_name(path)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules a file imports: ``from X import Y`` names X.Y when that is a module, else X."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known or sub in EXTENSIONS else base)
    return out


def public_vmalloc_names() -> set[str]:
    tree = ast.parse((ROOT / "vmalloc" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("vmalloc/__init__.py has no __all__")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    src = sources()
    return {name: imports(name, path, set(src)) for name, path in src.items()}


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_scan_sees_the_tree(graph):
    # The rules below are only as good as the scan: it must find the packages and their imports.
    assert {"swap", "swap.planning.planner", "vmalloc.arena", "bench.traces", "examples.plan_my_model"} <= set(graph)
    assert "swap.capture" in graph["swap.planning.planner"] and "vmalloc._C" in graph["vmalloc.arena"]


def test_vmalloc_imports_neither_swap_nor_bench(graph):
    bad = {(m, i) for m, deps in graph.items() if top(m) == "vmalloc" for i in deps if top(i) in ("swap", "bench")}
    assert not bad, bad


def test_nothing_but_bench_and_tests_imports_bench(graph):
    bad = {(m, i) for m, deps in graph.items() if top(m) != "bench" for i in deps if top(i) == "bench"}
    assert not bad, bad


def test_swap_reaches_vmalloc_only_through_its_public_names(graph):
    public = public_vmalloc_names()
    bad = set()
    for m, deps in graph.items():
        if top(m) != "swap":
            continue
        for i in deps:
            if top(i) == "vmalloc" and i != "vmalloc" and (i.split(".", 1)[1] not in public):
                bad.add((m, i))
    assert bad <= KNOWN, bad - KNOWN


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: every component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_check_finds_cycles():
    # bench.traces and bench.swap_trace imported each other before capture moved into swap.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    edges = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert not find_cycles(edges), f"import cycles: {find_cycles(edges)}"
