"""One rank's FSDP2 step on its lanes: the compute, the collectives and, with model-state offload, the shard copies
on the host link and the host steps on the host. Pure: swap/forecast/distributed.py measures the seconds per unit
from a rank's trace and reads the result.

Note [Model-state offload on one rank]
FSDP2 with ``CPUOffloadPolicy`` on the offloaded units and their update taken out of ``opt.step()`` by
``swap.fsdp2.HostSteps`` (Note [Host steps of offloaded FSDP2 units]). Per step, each offloaded unit u of a rank
(its shard: ``numel`` parameters) costs:
- two H2D copies of its master shard (``master_bytes`` a parameter), FSDP2's copy-in before each all-gather
  (forward and backward), on the H2D lane; the all-gather waits for its copy;
- one D2H copy of its gradient shard (``grad_bytes``) after its reduce-scatter, on the D2H lane;
- one host step, priced on the host profile (``HostProfile.step_seconds``: the optimizer's DRAM bytes over its
  rate) with the host's rate shared by the ``ranks_per_host`` ranks that step at the same time.
Timing is update-before-use: the host steps start when the backward's last gradient copy is done (``opt.step()``),
one after another in forward order, and the forward's copy-in of unit u starts no earlier than u's host step
ends (its gate). Three iterations run back to back and the last is the step (the host steps of one gate the
next). On top of the simulated lanes one bound is applied: the host's DRAM carries every rank's host steps and
DMA copies, so no step is shorter than those bytes over its DRAM bandwidth. Resident units are stepped on the
device (their optimizer's bytes over the device's memory bandwidth, after the backward).
Which term binds is the largest of: compute, collectives (each unit all-gathered twice and reduce-scattered
once), H2D, D2H, the host steps, and the host's DRAM. Not modelled: the link's share taken by swapped
activations (their copies share the H2D and D2H lanes) and the host memory the activation swap pool takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..devices import HostProfile, host_profile, host_step_bytes
from ..schedule.model_state import STATE_TENSORS, state_bytes


@dataclass(frozen=True)
class Offload:
    """Model-state offload under FSDP2 (``swap.plan(..., shard=Offload(...))``; ``shard="fsdp2-offload"`` takes the
    defaults): each unit not in ``resident`` keeps its master shard (``master_bytes`` a parameter), gradient shard
    (``grad_bytes``) and ``optimizer`` state on ``host``, shared by ``ranks_per_host`` ranks. The rank's trace then
    holds no model state at all: the resident units' (``resident_bytes``) must be taken off the budget given."""

    host: Union[str, HostProfile] = "server-ddr5-8ch"
    ranks_per_host: int = 8
    resident: frozenset[str] = frozenset()
    optimizer: str = "adamw"
    master_bytes: int = 4
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        if self.optimizer not in STATE_TENSORS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(STATE_TENSORS)}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be at least 1, not {self.ranks_per_host}")

    @property
    def profile(self) -> HostProfile:
        return host_profile(self.host)

    def bytes_per_parameter(self) -> int:
        """Model-state bytes a parameter of an offloaded unit holds: master, gradient and optimizer state."""
        return self.master_bytes + state_bytes(self.optimizer, self.master_bytes) + self.grad_bytes

    def host_step_bytes(self, numel: int) -> int:
        return host_step_bytes(self.optimizer, numel, self.master_bytes, self.grad_bytes)


def keep_resident(numel: dict[str, int], spec: Offload, reserve: int = 0) -> Offload:
    """``spec`` with the fewest units resident for the offloaded ones' model state (all ranks on one host) to
    fit the host's pinnable memory less ``reserve`` bytes (the activations' swap pool): units are kept resident
    from the first in the forward order on, after the root (Note [Model state under FSDP2]'s order of
    offloading, reversed). ``numel``: each unit's shard of one rank, in forward order, the root "" among them.
    Raises ValueError when no unit fits."""
    room = (spec.profile.pinnable - reserve) // (spec.ranks_per_host * spec.bytes_per_parameter())
    order = [u for u in reversed(list(numel)) if u] + [u for u in numel if not u]
    offloaded, total = [], 0
    for u in order:
        if total + numel[u] > room:
            break
        offloaded.append(u)
        total += numel[u]
    if not offloaded:
        raise ValueError(f"no unit's model state fits the host {spec.profile.name!r} for {spec.ranks_per_host} ranks")
    return Offload(**{**spec.__dict__, "resident": frozenset(u for u in numel if u not in offloaded)})


@dataclass(frozen=True)
class UnitSeconds:
    """What one rank's step costs per unit: blocks in forward and backward order, compute seconds per (unit,
    "f"/"b") with the root's own as ("root:head" / "root:tail", ...), one collective's seconds per unit ("" the
    root), and for offloaded units their H2D copy-in, D2H gradient copy and host step; ``device_step``: the
    resident units' optimizer step on the device."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]
    compute: dict[tuple[str, str], float]
    comm: dict[str, float]
    h2d: dict[str, float] = field(default_factory=dict)
    d2h: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    device_step: float = 0.0
    dram_seconds: float = 0.0  # the host's DRAM bytes per step over its bandwidth (all its ranks)


@dataclass(frozen=True)
class RankStep:
    """One rank's steady-state step (Note [Model-state offload on one rank])."""

    step_time: float
    compute_time: float  # the forward's and backward's compute (what the trace's simulated step already counts)
    terms: dict[str, float]  # what each resource needs per step; the step is no shorter than any

    @property
    def exposed(self) -> float:
        return max(0.0, self.step_time - self.compute_time)

    @property
    def bound(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)


def simulate_rank(s: UnitSeconds, iterations: int = 3) -> RankStep:
    """The step of ``s`` (Note [Collectives on the step] in swap/forecast/distributed.py, and Note [Model-state
    offload on one rank] where units are offloaded)."""
    compute, comm, off = s.compute, s.comm, s.h2d
    host_done: dict[str, float] = {}
    h2d_free = d2h_free = host_free = lane = 0.0
    t0 = prev = 0.0

    def gather(u: str, issue: float, lane: float, gate: bool) -> float:
        """An all-gather issued at ``issue``: after its copy-in when offloaded (after the unit's update when
        ``gate``); returns the lane's end."""
        nonlocal h2d_free
        start = max(lane, issue)
        if u in off:
            h2d_free = max(h2d_free, issue, host_done.get(u, 0.0) if gate else 0.0) + off[u]
            start = max(start, h2d_free)
        return start + comm[u]

    def run(order: tuple[str, ...], f: str, lane: float, clock: float, copied: list) -> tuple[float, float]:
        """The blocks in ``order``: a block waits for its all-gather; the next one's is issued when the block
        starts; the backward reduce-scatters each block (and copies an offloaded one's gradient out)."""
        nonlocal d2h_free
        ready = {}
        if order:
            lane = ready[order[0]] = gather(order[0], clock, lane, f == "f")
        clock += compute.get(("root:head", f), 0.0)
        for n, u in enumerate(order):
            start = max(clock, ready[u])
            if n + 1 < len(order):
                lane = ready[order[n + 1]] = gather(order[n + 1], start, lane, f == "f")
            clock = start + compute.get((u, f), 0.0)
            if f == "b":
                lane = max(lane, clock) + comm[u]
                if u in s.d2h:
                    d2h_free = max(d2h_free, lane) + s.d2h[u]
                    copied.append(d2h_free)
        return lane, clock + compute.get(("root:tail", f), 0.0)

    for _ in range(iterations):
        prev, copied = t0, []
        lane = clock = gather("", t0, max(lane, t0), True)  # the root's all-gather, before anything
        lane, clock = run(s.forward, "f", lane, clock, copied)
        lane, clock = run(s.backward, "b", lane, clock, copied)
        end = max(clock, lane) + comm[""]  # the root's reduce-scatter, after its last backward operator
        if "" in s.d2h:
            d2h_free = max(d2h_free, end) + s.d2h[""]
            copied.append(d2h_free)
        step = max([end, *copied])  # opt.step(): FSDP2's backward ends when its gradient copies are done
        for u in ("", *s.forward):
            if u in s.host:
                host_free = host_done[u] = max(host_free, step) + s.host[u]
        t0 = step + s.device_step
    busy = sum(compute.values())  # the trace's own compute: the rest (device step included) is exposed
    twice = 2 * sum(v for u, v in off.items() if u) + off.get("", 0.0)  # the root is all-gathered once a step
    terms = {"compute": busy + s.device_step, "collectives": 2 * comm[""] + 3 * sum(comm[u] for u in s.forward),
             "H2D": twice, "D2H": sum(s.d2h.values()), "host step": sum(s.host.values()),
             "host DRAM": s.dram_seconds}  # fmt: skip
    return RankStep(max(t0 - prev, s.dram_seconds), busy, terms)
