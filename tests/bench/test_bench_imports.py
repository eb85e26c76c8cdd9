"""Every benchmark module imports, and so does every project name it imports inside a function.

A benchmark is run by hand, seldom, so an import that drifted (a module moved) shows only when someone runs it:
``python -m bench.steady_state`` failed on ``from swap.zoo import resnet`` long after the zoo moved to
``swap.forecast``, because the import sat inside a function. This imports each module, then resolves each of
its imports of the project's own packages (swap, vmalloc, bench), wherever they sit in the file. Third-party
imports inside functions (transformers, torchvision, cuda.bindings) are optional extras and are not checked.
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("swap", "vmalloc", "bench")
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "bench").rglob("*.py")
                 if p.name != "__init__.py")  # fmt: skip


def project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of a project package in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PROJECT:
                found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] in PROJECT]
    return found


def test_every_bench_module_is_found():
    assert "bench.steady_state" in MODULES and "bench.gpu.quick" in MODULES and len(MODULES) > 30


def assert_project_imports_resolve(path: Path) -> None:
    """Each import of a project package in ``path`` names a module that imports and names it has."""
    where = path.relative_to(ROOT)
    for line, module, names in project_imports(path):
        try:
            m = importlib.import_module(module)
        except ImportError as e:
            pytest.fail(f"{where}:{line}: `{module}` does not import: {e}")
        for n in names:
            if n != "*" and not hasattr(m, n):
                try:  # a submodule not yet imported: `from swap.forecast import zoo`
                    importlib.import_module(f"{module}.{n}")
                except ImportError:
                    pytest.fail(f"{where}:{line}: `{module}` has no `{n}`")


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_and_its_project_imports_resolve(name):
    importlib.import_module(name)
    assert_project_imports_resolve(ROOT / Path(*name.split(".")).with_suffix(".py"))


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_project_import_of_an_example_resolves(name):
    """Examples are scripts (running one trains a model), so only their imports of the project are resolved."""
    assert_project_imports_resolve(ROOT / "examples" / name)
