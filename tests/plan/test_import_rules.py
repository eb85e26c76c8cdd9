"""DESIGN.md's import rules, checked on the source tree (every import statement, also those inside
functions): vmalloc imports neither swap nor bench; swap reaches vmalloc only through its public names and
never imports bench; nothing outside bench/ and tests/ imports bench; no import cycles among the project's
modules; and swap's rooms (ARCHITECTURE.md) stand in layers: a room imports only rooms below it."""

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
    # name for it yet (swap/runtime/machine/memory.py and vmalloc's exports belong to the torch-facing work).
    ("swap.runtime.machine.memory", "vmalloc._C"),
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
    assert {"swap", "swap.forecast.planner", "vmalloc.arena", "bench.traces", "examples.plan_my_model"} <= set(graph)
    assert "swap.capture" in graph["swap.forecast.planner"] and "vmalloc._C" in graph["vmalloc.arena"]


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
    # bench.traces and swap.forecast.from_trace imported each other before capture moved into swap.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    edges = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert not find_cycles(edges), f"import cycles: {find_cycles(edges)}"


# swap's rooms, lowest layer first (ARCHITECTURE.md, "Rooms"), and the modules or packages each holds: a
# module belongs to the room of its longest prefix here, and imports only its own room and rooms below it.
LAYERS = {"units": 0, "schedule": 1, "capture": 1, "joint": 2, "devices": 2, "forecast": 3, "runtime": 3, "tiling": 3,
          "front": 4}
ROOMS = {
    "swap.units": "units",
    "swap.schedule": "schedule",
    "swap.capture": "capture",
    "swap.joint": "joint",
    "swap.devices": "devices",
    "swap.forecast": "forecast",
    "swap.runtime": "runtime",
    "swap.tiling": "tiling",
    # the front: public names, the command line, trainer glue
    "swap": "front",
    "swap.__main__": "front",
    "swap.plan": "front",
    "swap.cli": "front",
    "swap.integrations": "front",
}
FRONT = {"swap", "swap.__main__", "swap.plan", "swap.cli"}  # the front's modules directly in swap/


def room_of(module: str) -> str | None:
    """The room of a module of swap; None for a module directly in swap/ that no room names."""
    if module in FRONT:
        return "front"
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ROOMS[".".join(parts[:n])]
    return None


def upward_imports(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module, import) pairs of swap where a room imports another room of its own layer or above."""
    bad = set()
    for m, deps in edges.items():
        if top(m) != "swap":
            continue
        for i in deps:
            a, b = room_of(m), room_of(i)
            if top(i) == "swap" and None not in (a, b) and a != b and LAYERS[b] >= LAYERS[a]:
                bad.add((m, i))
    return bad


def test_the_room_check_finds_upward_imports():
    assert upward_imports({"swap.schedule.budget": {"swap.joint.ops"}}) == {("swap.schedule.budget", "swap.joint.ops")}
    assert upward_imports({"swap.runtime.manager": {"swap.forecast.planner"}})  # same layer: neither above
    assert not upward_imports({"swap.forecast.planner": {"swap.schedule.scheduler", "swap.devices"}})


def test_every_swap_module_is_in_a_room(graph):
    homeless = sorted(m for m in graph if top(m) == "swap" and room_of(m) is None)
    assert not homeless, f"not in any room of ROOMS (ARCHITECTURE.md says where each kind of code goes): {homeless}"


def module_edges(graph: dict[str, set[str]], known: set[str]) -> dict[str, set[str]]:
    """Each module of ``known`` -> the modules of ``known`` it imports."""
    edges = {}
    for m in known:
        out = set()
        for d in graph[m]:  # ``from swap.x import name`` names swap.x.name; the module is its longest known prefix
            while d and d not in known:
                d = d.rpartition(".")[0]
            if d and d != m:
                out.add(d)
        edges[m] = out
    return edges


def test_rooms_import_only_lower_rooms(graph):
    bad = upward_imports(module_edges(graph, {m for m in graph if top(m) == "swap"}))
    assert not bad, f"imports from a room to one not below it: {sorted(bad)}"
    assert len(set(LAYERS.values())) <= 6 and set(ROOMS.values()) == set(LAYERS)


# swap/runtime's own rooms (ARCHITECTURE.md, "The rooms of swap/runtime/"), lowest first; the modules directly in
# swap/runtime/ (the manager and its helpers) are the top. Same rule: a sub-room imports only sub-rooms below it.
RUNTIME_LAYERS = {"machine": 0, "activations": 1, "auto": 2, "model_state": 3, "top": 4}


def runtime_room(module: str) -> str | None:
    """The sub-room of a module of swap.runtime; None outside swap.runtime (and for the forwarders' table)."""
    parts = module.split(".")
    if parts[:2] != ["swap", "runtime"] or module in ("swap.runtime", "swap.runtime._moved"):
        return None
    return parts[2] if len(parts) > 3 and parts[2] in RUNTIME_LAYERS else "top"


def runtime_upward_imports(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for m, deps in edges.items():
        for i in deps:
            a, b = runtime_room(m), runtime_room(i)
            if None not in (a, b) and a != b and RUNTIME_LAYERS[b] >= RUNTIME_LAYERS[a]:
                bad.add((m, i))
    return bad


def test_the_runtime_room_check_finds_upward_imports():
    assert runtime_upward_imports({"swap.runtime.machine.memory": {"swap.runtime.activations.tracer"}})
    assert runtime_upward_imports({"swap.runtime.activations.executor": {"swap.runtime.manager"}})
    assert not runtime_upward_imports({"swap.runtime.model_state.runtime": {"swap.runtime.machine.host_pool"}})


def test_runtime_rooms_import_only_lower_rooms(graph):
    bad = runtime_upward_imports(module_edges(graph, {m for m in graph if m.startswith("swap.runtime")}))
    assert not bad, f"imports from a sub-room of swap/runtime to one not below it: {sorted(bad)}"


def test_nothing_imports_a_moved_module_by_its_old_name(graph):
    # The old names forward for one release (swap/runtime/_moved.py); the project's own code uses the new ones.
    from swap.runtime._moved import new_name

    bad = sorted((m, d) for m, deps in graph.items() for d in deps if new_name(d) is not None)
    assert not bad, f"old names of moved modules: {bad}"
