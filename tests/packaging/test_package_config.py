"""What the wheel ships, read from pyproject.toml in a second; .ci/check_package.sh builds, installs and runs
the wheel and the sdist for real (Note [What installs build and what they need] in pyproject.toml)."""

from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def package_find_config() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]


def test_every_folder_of_python_files_in_swap_and_vmalloc_is_found_as_a_package():
    config = package_find_config()
    assert config.get("namespaces") is False  # a folder is a package by its __init__.py, nothing else
    found = set(find_packages(where=str(ROOT), include=config["include"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("swap", "vmalloc")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}  # fmt: skip
    missing = sorted(folders - found)
    assert not missing, f"{missing} would not be in the wheel: give each an __init__.py"
    assert {name.split(".")[0] for name in found} == {"swap", "vmalloc"}  # bench, tests, examples stay here


def test_the_build_and_run_time_needs_are_declared():
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    build = " ".join(config["build-system"]["requires"])
    assert all(name in build for name in ("setuptools", "pybind11", "cmake", "nvidia-cuda-runtime")), build
    assert "ninja" in config["project"]["dependencies"]  # the torch adapter's run-time build runs it
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "include CMakeLists.txt" in manifest and "recursive-include csrc" in manifest
