"""The modules that moved into swap/runtime's sub-rooms keep their old names for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

from swap.runtime._moved import MOVED, new_name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_warns_and_gives_the_module_itself(old):
    name = f"swap.runtime.{old}"
    sys.modules.pop(name, None)
    with pytest.warns(FutureWarning, match=rf"{name} moved to swap\.runtime\.{MOVED[old]}\.{old}"):
        forwarded = importlib.import_module(name)
    assert forwarded is importlib.import_module(new_name(name))
    sys.modules.pop(name, None)


def test_from_import_of_a_name_through_the_old_path():
    sys.modules.pop("swap.runtime.memory", None)
    with pytest.warns(FutureWarning):
        from swap.runtime.memory import DeviceMemory
    from swap.runtime.machine.memory import DeviceMemory as today

    assert DeviceMemory is today
    sys.modules.pop("swap.runtime.memory", None)


def test_names_that_never_moved_are_not_forwarded():
    assert new_name("swap.runtime.manager") is None
    assert new_name("swap.runtime.nothing_here") is None
    assert new_name("swap.runtime.machine.memory") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("swap.runtime.nothing_here")
