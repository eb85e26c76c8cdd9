"""Forwarders for the modules that moved into swap/runtime's sub-rooms: ``import swap.runtime.executor`` still
works, warns once with the new name, and gives the module itself (one module object under both names, so
monkeypatching through either reaches the same code). To be removed one release after the move.

Note [Forwarders for moved modules]
One table instead of a file per moved module: the folder shows the rooms a newcomer should read, not 27 stubs.
A finder on sys.meta_path answers only for the old names in the table; everything else falls through to the
normal import system."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Optional

# old name (under swap.runtime) -> its sub-room
MOVED = {
    **dict.fromkeys(("engines", "host_pool", "memory", "meter", "timers", "resources"), "machine"),
    **dict.fromkeys(("signals", "tracer", "clean", "transfers", "lifecycle", "plan_book", "recorder", "residency",
                     "conservative", "eviction", "kept", "executor", "hooks", "recompute"), "activations"),
    **dict.fromkeys(("op_facts", "op_profiler", "regions", "ranks", "joint"), "auto"),
    **dict.fromkeys(("fsdp2", "fsdp2_steps"), "model_state"),
}
PACKAGE = "swap.runtime"


def new_name(old: str) -> Optional[str]:
    """The module's name today, for an old ``swap.runtime.<name>``; None for a name that did not move."""
    head, _, leaf = old.rpartition(".")
    if head != PACKAGE or leaf not in MOVED:
        return None
    return f"{PACKAGE}.{MOVED[leaf]}.{leaf}"


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.target}; import it from there (the old name goes in the next "
                      f"release)", FutureWarning, stacklevel=2)
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        # The module is the real one, already executed; the import system files it under the old name too.
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        moved = new_name(fullname)
        return None if moved is None else importlib.machinery.ModuleSpec(fullname, _Alias(moved))


def install() -> None:
    """Put the finder on sys.meta_path once."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
