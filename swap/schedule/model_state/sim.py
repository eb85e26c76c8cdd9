"""The iteration with model state, simulated: a compute stream, H2D and D2H copy engines, and a host-step lane.

Note [Model-state simulation]
``simulate_model_state`` replays a schedule of a sequence with weights (``weights``) for a few
iterations back to back and reports the last (the steady state: the host steps of one iteration gate the next).
It follows ``Schedule.actions`` as ``swap.schedule.simulator.simulate`` does (releases wait for the D2H copy
of what is not clean; swap-ins queue H2D copies; a use waits for its copy; swap-outs queue D2H copies; then the
step computes), and adds model state:

- gradients: when the compute of an offloaded bucket's last backward step ends, its gradient's D2H copy is
  queued; before the next step at most ``in_flight`` such copies may be outstanding (the device bytes the
  plan reserved for them), so the compute stream waits for the oldest;
- the device step: resident buckets' optimizer step runs on the compute stream after the backward
  (``device_step_seconds`` of each);
- the host lane: one worker runs the host steps one after another. ``timing``:
  - ``"blocking"``: all host steps run after the backward (at ``opt.step()``), in forward order; the next
    iteration starts when every one of them and every host master's update copy is done (ZeRO-Offload,
    ZeRO-3-offload, FSDP2's CPU offload and torchao's optimizer step this way);
  - ``"before_use"``: the same host steps, but the next iteration starts at once and each bucket waits only
    where it is next read: a streamed bucket's fetch starts no earlier than its host step's end, a host
    master's first forward use waits for its update copy (queued when its host step ends);
  - ``"speculative"``: as ``"before_use"``, and the plan's staged buckets (``ModelStatePlan.speculated``: the
    runtime's, every offloaded bucket, Note [Speculation as the runtime decides it] in choice) start their host
    step as soon as their gradient is on the host, during the backward (the iteration's one backward is the last
    before ``opt.step()``, the one the runtime speculates in), each first copying its master and state for a
    rollback (``save_seconds``, ``save_bytes``); committed at ``opt.step()``, which costs nothing here: every
    speculation is assumed to hold (a failed one, thrown away and redone, is not priced);
- casts: a bucket fetched in another dtype than it computes in (the master, cast on the device) costs
  ``cast_seconds`` on the compute stream at its first use after each fetch; a cast on the host is in the
  host step's bytes (``swap.devices.host_step_bytes``' ``copy``), except the runtime's mixed precision, which casts
  on the thread that runs the model once per change of the master (its first fetch after the host step), priced
  as ``cast_seconds`` too, once an iteration (``cast_once``; Note [Mixed precision pricing] in
  swap/forecast/offload.py);
- the link: copies on an engine take the earliest gap from when they are ready (copies of different streams
  interleave); with ``duplex_bandwidth`` set, a copy is slowed while the other direction is busy, to the
  share of ``duplex_bandwidth`` its direction gets;
- DRAM: with ``dram_bandwidth`` set, a host step is no faster than its bytes plus the DMA traffic of the
  copies already placed beside it, over the DRAM bandwidth (copies placed later are not seen).

``lower_bound`` is the largest of the compute stream's seconds, each direction's bytes over its bandwidth
(both over ``duplex_bandwidth``), and the host steps' seconds; ``bound`` names it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from ..scheduler import Schedule
from .plan import Bucket, ModelStatePlan, Placement
from .weights import BucketUses, Weighted

TIMINGS = ("blocking", "before_use", "speculative")


@dataclass(frozen=True)
class ModelStatePrices:
    """What model state costs, per bucket where it depends on the bucket (Note [Model-state simulation]).

    Attributes:
        h2d_bandwidth, d2h_bandwidth: bytes/s of each copy engine.
        host_step_seconds: per bucket, its host step.
        device_step_seconds: per bucket, its optimizer step on the device (counted for resident buckets).
        cast_seconds: per bucket, the cast of a fetched copy on the compute stream (empty: none: the host step
            casts).
        cast_once: the cast only at a bucket's first fetch of the iteration (the runtime's mixed precision casts
            a master once per change of it, Note [One cast per master change]); else at every fetch.
        host_step_bytes: per bucket, the DRAM bytes of its host step (for DRAM contention; empty: none).
        dram_bandwidth: host DRAM bytes/s shared by host steps and DMA (0: no contention).
        duplex_bandwidth: bytes/s of both directions at once (0: each at its own rate).
        save_seconds: per bucket, the rollback copy a speculative host step makes first (Note [Rollback copies] in
            ledger), added to its host step when it speculates (empty: free).
        save_bytes: per bucket, the DRAM bytes of that copy (for DRAM contention; empty: none).
    """

    h2d_bandwidth: float
    d2h_bandwidth: float
    host_step_seconds: tuple[float, ...]
    device_step_seconds: tuple[float, ...] = ()
    cast_seconds: tuple[float, ...] = ()
    host_step_bytes: tuple[float, ...] = ()
    dram_bandwidth: float = 0.0
    duplex_bandwidth: float = 0.0
    cast_once: bool = False
    save_seconds: tuple[float, ...] = ()
    save_bytes: tuple[float, ...] = ()


@dataclass
class ModelStateSim:
    """One steady-state iteration with model state (Note [Model-state simulation])."""

    step_time: float
    compute_time: float  # the compute stream's own seconds: steps, device step, casts
    stall_time: float
    stalls: dict[str, float]  # seconds the compute stream waited, by what it waited for
    h2d_bytes: int
    d2h_bytes: int
    host_seconds: float  # the host steps' seconds, speculative ones' rollback copies included
    host_exposed: float  # of the stalls, those waiting on a host step (directly or through its copy)
    lower_bound: float
    bound: str  # "compute", "h2d", "d2h", "link" or "host"
    bytes_by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)  # kind -> (H2D, D2H) bytes
    speculated: int = 0  # host steps started before opt.step()
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        """Step time over the lower bound (1.0: nothing exposed)."""
        return self.step_time / self.lower_bound if self.lower_bound else 1.0


class Lane:
    """A copy engine, or the host worker: busy intervals, sorted; work takes the earliest gap it fits."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def find(self, ready: float, seconds: float) -> tuple[int, float]:
        """Where ``seconds`` of work ready at ``ready`` would go: (position, start) of the first gap that holds it."""
        i = bisect.bisect_right(self.ends, ready)
        start = ready
        while i < len(self.starts) and start + seconds > self.starts[i]:
            start = max(start, self.ends[i])
            i += 1
        return i, start

    def place(self, ready: float, seconds: float) -> tuple[float, float]:
        """Books ``seconds`` of work ready at ``ready`` into the first gap that holds it: (start, end)."""
        i, start = self.find(ready, seconds)
        self.starts.insert(i, start)
        self.ends.insert(i, start + seconds)
        return start, start + seconds

    def busy(self, a: float, b: float) -> float:
        """Seconds of [a, b) this lane is busy."""
        out = 0.0
        i = bisect.bisect_right(self.ends, a)
        while i < len(self.starts) and self.starts[i] < b:
            out += min(b, self.ends[i]) - max(a, self.starts[i])
            i += 1
        return out


class _Run:
    """The state of one simulation (Note [Model-state simulation])."""

    def __init__(self, w: Weighted, schedule: Schedule, buckets: Seq[Bucket], uses: Seq[BucketUses],
                 plan: ModelStatePlan, prices: ModelStatePrices, timing: str, in_flight: int,
                 timeline: bool) -> None:  # fmt: skip
        self.w, self.schedule, self.buckets, self.plan, self.prices = w, schedule, buckets, plan, prices
        self.timing, self.in_flight, self.record = timing, in_flight, timeline
        self.h2d, self.d2h, self.host = Lane(), Lane(), Lane()
        self.t = 0.0
        n = len(w.seq)
        self.bucket_of = {v: k for k, v in w.var_of.items()}
        self.final_at: dict[int, list[int]] = defaultdict(list)  # step named by the uses -> buckets made final
        self.gate_at: dict[int, list[int]] = defaultdict(list)  # step -> host masters first read there
        self.offloaded = [k for k, (u, p) in enumerate(zip(uses, plan.placements))
                          if p != Placement.RESIDENT and u.has_grad]  # fmt: skip
        for k in self.offloaded:
            self.final_at[uses[k].grad_final].append(k)
            if plan.placements[k] == Placement.HOST_MASTER and uses[k].forward:
                self.gate_at[w.step_of(min(uses[k].forward))].append(k)
        steps = prices.device_step_seconds or (0.0,) * len(buckets)
        self.device_step = sum(steps[k] for k, p in enumerate(plan.placements)
                               if p == Placement.RESIDENT and uses[k].has_grad)  # fmt: skip
        self.host_done: dict[int, float] = {}
        self.update_done: dict[int, float] = {}
        self.n = n
        self.new_iteration()

    def new_iteration(self) -> None:
        self.stalls: dict[str, float] = defaultdict(float)
        self.h2d_bytes = self.d2h_bytes = 0
        self.kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.compute = 0.0
        self.host_exposed = 0.0
        self.speculated = 0
        self.lanes: list[tuple[str, float, float, str]] = []

    # -- the link ------------------------------------------------------------------------------------------
    def copy(self, lane: Lane, ready: float, nbytes: int, h2d: bool, label: str) -> float:
        """Books a copy of ``nbytes`` ready at ``ready``; returns when it is done (Note [Model-state
        simulation]: the duplex limit slows the part that overlaps the other direction)."""
        p = self.prices
        bw = p.h2d_bandwidth if h2d else p.d2h_bandwidth
        seconds = nbytes / bw
        if p.duplex_bandwidth and p.duplex_bandwidth < p.h2d_bandwidth + p.d2h_bandwidth:
            other = self.d2h if h2d else self.h2d
            start = lane.find(ready, seconds)[1]
            share = p.duplex_bandwidth / (p.h2d_bandwidth + p.d2h_bandwidth)
            seconds += other.busy(start, start + seconds) * (1 / share - 1)
        start, end = lane.place(ready, seconds)
        if self.record:
            self.lanes.append(("h2d" if h2d else "d2h", start, end, label))
        return end

    def wait(self, until: float, cause: str, host: bool = False) -> None:
        if until > self.t:
            self.stalls[cause] += until - self.t
            if host:
                self.host_exposed += until - self.t
            if self.record:
                self.lanes.append(("stall", self.t, until, cause))
            self.t = until

    def host_step(self, k: int, ready: float, speculative: bool = False) -> float:
        """Runs bucket k's host step on the worker from ``ready`` (``speculative``: its rollback copy first);
        returns its end."""
        p = self.prices
        seconds = p.host_step_seconds[k] + (p.save_seconds[k] if speculative and p.save_seconds else 0.0)
        nbytes = p.host_step_bytes[k] + (p.save_bytes[k] if speculative and p.save_bytes else 0.0) \
            if p.host_step_bytes else 0.0  # fmt: skip
        start = self.host.find(ready, seconds)[1]
        if p.dram_bandwidth and p.host_step_bytes:
            dma = (self.h2d.busy(start, start + seconds) * p.h2d_bandwidth
                   + self.d2h.busy(start, start + seconds) * p.d2h_bandwidth)  # fmt: skip
            seconds = max(seconds, (nbytes + dma) / p.dram_bandwidth)
        start, end = self.host.place(ready, seconds)
        if self.record:
            self.lanes.append(("host", start, end, f"b{k}"))
        return end

    # -- one iteration --------------------------------------------------------------------------------------
    def iteration(self, first: bool) -> float:
        seq, s, b = self.w.seq, self.schedule, self.buckets
        gated = not first and self.timing != "blocking"
        if not first and self.timing == "blocking":
            done = list(self.host_done.values()) + list(self.update_done.values())
            self.wait(max(done, default=0.0), "host", host=True)
        h2d_done: dict[int, float] = {}
        host_gated: set[int] = set()
        d2h_done: dict[int, float] = {}
        grad_done: dict[int, float] = {}
        outstanding: deque[int] = deque()
        cast_pending: set[int] = set()
        cast_buckets: set[int] = set()  # buckets cast this iteration (cast_once)
        new_done: dict[int, float] = {}
        staged = set(self.plan.speculated()) if self.timing == "speculative" else set()
        for i in range(self.n):
            for v in s.release[i]:
                if not seq.clean[v]:
                    self.wait(d2h_done.get(v, 0.0), "release")
            for v in s.swap_in[i]:
                k = self.bucket_of.get(v)
                ready = self.t
                if k is not None and gated and self.host_done.get(k, 0.0) > ready:
                    ready = self.host_done[k]
                    host_gated.add(v)
                h2d_done[v] = self.copy(self.h2d, ready, seq.sizes[v], True, f"v{v}")
                self.h2d_bytes += seq.sizes[v]
                self.kinds["weights" if k is not None else "activations"][0] += seq.sizes[v]
                if k is not None and self.prices.cast_seconds and not (self.prices.cast_once and k in cast_buckets):
                    cast_pending.add(v)
                    cast_buckets.add(k)
            if gated:
                for k in self.gate_at.get(i, ()):
                    self.wait(self.update_done.get(k, 0.0), "update", host=True)
            v = seq.var[i]
            if seq.kind[i] != "save":
                self.wait(h2d_done.get(v, 0.0), "fetch", host=v in host_gated)
            if v in cast_pending:
                cast_pending.discard(v)
                self.busy(self.prices.cast_seconds[self.bucket_of[v]], "cast")
            for u in s.swap_out[i]:
                if not seq.clean[u]:
                    d2h_done[u] = self.copy(self.d2h, self.t, seq.sizes[u], False, f"v{u}")
                    self.d2h_bytes += seq.sizes[u]
                    self.kinds["activations"][1] += seq.sizes[u]
            runs = zip(self.w.runs[i], self.w.seconds[i]) if self.w.runs else [(i, seq.compute[i])]
            for j, seconds in runs:  # the compute of each step the uses name, and the gradients it finishes
                self.busy(seconds, f"step {i}")
                for k in self.final_at.get(j, ()):
                    grad_done[k] = self.copy(self.d2h, self.t, b[k].grad_bytes, False, f"g{k}")
                    self.d2h_bytes += b[k].grad_bytes
                    self.kinds["gradients"][1] += b[k].grad_bytes
                    outstanding.append(k)
                    if k in staged:
                        new_done[k] = self.host_step(k, grad_done[k], speculative=True)
                        self.speculated += 1
                while len(outstanding) > self.in_flight:
                    self.wait(grad_done[outstanding.popleft()], "gradients")
        self.busy(self.device_step, "device step")
        confirm = self.t  # opt.step()
        for k in self.offloaded:  # forward order: what the next forward reads first is stepped first
            if k not in new_done:
                new_done[k] = self.host_step(k, max(confirm, grad_done.get(k, confirm)))
        for k in self.offloaded:
            if self.plan.placements[k] == Placement.HOST_MASTER:
                self.update_done[k] = self.copy(self.h2d, new_done[k], b[k].weight_bytes, True, f"u{k}")
                self.h2d_bytes += b[k].weight_bytes
                self.kinds["weights"][0] += b[k].weight_bytes
        self.host_done = new_done
        return self.t

    def busy(self, seconds: float, label: str) -> None:
        if seconds > 0:
            if self.record:
                self.lanes.append(("compute", self.t, self.t + seconds, label))
            self.t += seconds
            self.compute += seconds


def simulate_model_state(
    w: Weighted,
    schedule: Schedule,
    buckets: Seq[Bucket],
    uses: Seq[BucketUses],
    plan: ModelStatePlan,
    prices: ModelStatePrices,
    *,
    timing: str = "before_use",
    in_flight: int = 2,
    iterations: int = 3,
    timeline: bool = False,
) -> ModelStateSim:
    """The steady-state iteration of ``schedule`` (a plan of ``w.seq``) with ``plan``'s model state (Note
    [Model-state simulation]); ``in_flight`` as given to ``with_weights``."""
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}: choose one of {', '.join(TIMINGS)}")
    if iterations < 2:
        raise ValueError("iterations must be at least 2: the last is measured after one that gates it")
    if len(prices.host_step_seconds) != len(buckets):
        raise ValueError(f"host_step_seconds has {len(prices.host_step_seconds)} entries for {len(buckets)} buckets")
    run = _Run(w, schedule, buckets, uses, plan, prices, timing, in_flight, timeline)
    ends = []
    for it in range(iterations):
        if it == iterations - 1:
            run.new_iteration()
        ends.append(run.iteration(first=it == 0))
    step = ends[-1] - ends[-2]
    staged = set(plan.speculated()) if timing == "speculative" and prices.save_seconds else set()
    host = sum(prices.host_step_seconds[k] + (prices.save_seconds[k] if k in staged else 0.0) for k in run.offloaded)
    terms = {"compute": run.compute, "h2d": run.h2d_bytes / prices.h2d_bandwidth,
             "d2h": run.d2h_bytes / prices.d2h_bandwidth, "host": host}  # fmt: skip
    if prices.duplex_bandwidth:
        terms["link"] = (run.h2d_bytes + run.d2h_bytes) / prices.duplex_bandwidth
    bound = max(terms, key=lambda name: terms[name])
    return ModelStateSim(
        step, run.compute, sum(run.stalls.values()), dict(run.stalls), run.h2d_bytes, run.d2h_bytes, host,
        run.host_exposed, terms[bound], bound, {k: (v[0], v[1]) for k, v in run.kinds.items()}, run.speculated,
        run.lanes,
    )  # fmt: skip
