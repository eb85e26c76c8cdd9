"""Clean variables at run time: a bucket of weights that the executor schedules like a saved activation, whose
moves another object makes (the model-state streamer).

Note [Clean variables at run time]
A bucket of streamed weights is a variable of the iteration (Note [Clean variables] in swap/schedule/sequence.py):
each use of it (a module's forward pre-hook, a backward read of a saved view) is a step, so the window that
prefetches activations prefetches weights too, and a release drops them with no copy out. The executor keeps one
``CleanVariable`` per bucket and iteration; fetching, readying and dropping it are the ``CleanMover``'s (the weights
live in the parameters' own storages, not in a copy the executor owns), and so is whether it is on the device.

A bucket is *pinned* while something running reads it: a module whose forward pre-hook used it and whose forward
has not returned, or the backward node running now. Its forward use therefore holds it until the module returns: the
saves the module's operators make in between share the use's node group, so the profile's ``node_last`` keeps the
scheduler from releasing it before (Note [Step windows]'s groups, swap.runtime.activations.executor). A release
that comes
while it is pinned anyway (a plan made before the profile saw it) is carried out when the pin ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Protocol

_HOME = object()  # a clean variable's host copy: always valid
_HERE = object()  # stands for its device copy while the mover says the weights are on the device


class CleanMover(Protocol):
    """Moves buckets of weights for the executor (swap.runtime.model_state.streaming.Streamer)."""

    def fetch(self, key: int, prefetch: bool) -> None:
        """Starts bringing bucket ``key``'s weights to the device (a prefetch may skip a bucket whose host update
        is still running: its use fetches it)."""

    def ready(self, key: int) -> float:
        """Bucket ``key``'s weights may be read now; returns the seconds waited."""

    def drop(self, key: int) -> None:
        """Bucket ``key`` leaves the device (now, or when its pin ends)."""

    def on_device(self, key: int) -> bool: ...

    def pinned(self, key: int) -> bool:
        """Whether something running now reads bucket ``key``."""

    def variables(self, first_id: int, iteration: int, owner: Any) -> list[CleanVariable]:
        """One variable per streamed bucket, numbered from ``first_id``: the first variables of an iteration (so
        a planned iteration numbers them as its profile did, and can fetch one before its first use). ``owner``
        (swap.runtime.activations.residency.Residency) is told when one leaves the device between steps."""


class CleanVariable:
    """A bucket of weights as one variable of an iteration (Note [Clean variables at run time])."""

    __slots__ = ("id", "key", "nbytes", "size", "mover", "iteration", "last_access", "module", "alive", "h2d", "d2h",
                 "versions", "owner")  # fmt: skip
    # Never a fetched copy of a forward's storage: the conservative plan keeps only those for a near use (Note
    # [Kept for a near use]); a bucket's next use is the streamer's to plan.
    dev_is_copy = False

    def __init__(self, vid: int, key: int, nbytes: int, mover: CleanMover, iteration: int, owner: Any = None) -> None:
        self.id = vid
        self.key = key
        self.nbytes = self.size = nbytes
        self.mover = mover
        self.iteration = iteration
        self.last_access = -1
        self.module = ""
        self.alive = True  # for the whole iteration: the weights outlive it
        self.h2d: Any = None  # the mover waits for its own copies
        self.d2h: Any = None
        self.versions: list = []
        self.owner = owner

    @property
    def host(self) -> Any:
        return _HOME

    @property
    def dev(self) -> Optional[Any]:
        return _HERE if self.mover.on_device(self.key) else None

    def pinned(self) -> bool:
        return self.mover.pinned(self.key)

    def unchanged(self) -> bool:
        return True

    def original(self) -> None:
        return None

    def check_versions(self, when: str = "") -> None:
        """Weights are written only by the host step, between iterations."""


def on_device_bytes(variables: Iterable[CleanVariable], iteration: int) -> int:
    """Bytes of ``iteration``'s clean variables on the device (the mover says where they are)."""
    return sum(v.size for v in variables if v.iteration == iteration and v.dev is not None)
