"""The documents and the public names say what the code has (issue 39's drift): no name leaks into ``swap``'s
namespace, ``swap.plan``'s docstring documents each parameter once, the results files name paths that exist,
and the joint runtime is read through ``SwapManager.joint_view``, a frozen copy."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest

import swap
from swap.forecast import planner

ROOT = Path(__file__).resolve().parents[2]


def test_swap_exports_only_its_names_and_subpackages():
    # ``from __future__ import annotations`` left ``swap.annotations`` (a __future__ feature) in the namespace.
    public = {n for n in dir(swap) if not n.startswith("_")}
    stray = {n for n in public - set(swap.__all__) if not isinstance(getattr(swap, n), types.ModuleType)}
    assert not stray, f"public names outside swap.__all__: {sorted(stray)}"
    modules = {n for n in public - set(swap.__all__)}
    assert all(getattr(swap, n).__name__ == f"swap.{n}" for n in modules), "a module from elsewhere in swap's namespace"


def test_plan_docstring_documents_every_parameter_once():
    # ``batch`` was documented twice; ``steps`` and ``name`` not at all.
    doc = inspect.getdoc(planner.plan)
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    heads = re.findall(r"^    ([a-z_0-9]+(?:, [a-z_0-9]+)*):", args, flags=re.M)
    documented = [name for head in heads for name in head.split(", ")]
    params = list(inspect.signature(planner.plan).parameters)
    assert sorted(documented) == sorted(params), (set(params) ^ set(documented), documented)


def test_results_files_name_paths_that_exist():
    # Four results files named swap/planning/..., a package that moved.
    pattern = re.compile(r"\b((?:swap|vmalloc|bench|csrc|tests|examples)/[\w/]+\.(?:py|cpp|h|md|json))\b")
    missing = []
    for md in sorted((ROOT / "bench" / "results").rglob("*.md")):
        for path in pattern.findall(md.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{md.relative_to(ROOT)}: {path}")
        if "swap.planning" in md.read_text():
            missing.append(f"{md.relative_to(ROOT)}: swap.planning")
    assert not missing, "\n".join(missing)


def test_joint_view_is_a_frozen_copy():
    sm = swap.SwapManager(budget="1GiB", device="cpu")  # strategy="auto", the default
    view = sm.joint_view
    assert view.searching and not view.decided and view.result is None and not view.applied
    assert not view.rebuilding and view.rebuilt == 0 and dict(view.regions) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.rebuilt = 1
    with pytest.raises(TypeError):
        view.regions["0"] = None
    assert not swap.SwapManager(budget="1GiB", device="cpu", policy="window").joint_view.searching
    assert swap.SwapManager(budget="1GiB", device="cpu", policy="window", recompute=True).joint_view.rebuilding
