"""``swap.plan``: the largest batch of the user's model that fits a budget, per swap policy, and its speed.

Captures the model's training step on the meta device (``swap.capture``), scales it to any batch size when
the trace is provably linear in the batch (Note [Linear traces]), and searches, per policy, the largest
batch whose plan fits: the scheduler must meet the budget and, with an allocator, the swapped run must
replay within the budget on that allocator (vmalloc's real core on its sim backend, or models of PyTorch's
allocator); fragmentation lowers the budget the schedule is made for until it does
(``swap.forecast.replay.fitting_budget``). Step times come from simulating the schedule on the device profile.

Note [Model-state offload unasked]
The question most asked of a planner ("will this model's full fine-tune fit that card?") is answered "no batch
fits" when the model state alone outgrows the device, though offloading it to the host would fit. So when
nothing fits and no ``host`` was named, ``swap.plan`` forecasts model-state offload anyway, at ``batch`` (or 1),
on a named default host profile (``swap.devices.default_host``), and says so in a note: whether it fits, how
fast (simulated), on which host, and how to choose another. The plan then has a way to train the model, and
``python -m swap.plan`` exits 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Optional, Union

import torch

from ..capture import CaptureError, LinearTrace, Trace, capture, live_peak
from ..devices import (
    HOST_PROFILES,
    DeviceProfile,
    HostProfile,
    InterconnectProfile,
    default_host,
    host_profile,
    read_measured,
    refuse_budget_above,
    with_measured,
    with_tf32,
)
from ..devices import profile as device_profile
from ..schedule.budget import min_budget
from ..schedule.model_state import ModelStatePolicy, policy_of
from ..schedule.scheduler import POLICIES, InfeasibleBudget
from ..schedule.scheduler import plan as make_schedule
from ..schedule.sequence import Sequence
from ..schedule.simulator import Scheduled, schedule_for
from ..units import Size, parse_size
from ..units import fmt_size as fmt_bytes
from . import distributed
from .arguments import check_functions, check_model_fn, check_names, with_parameters
from .from_trace import sequence_from_trace
from .offload import check_mixed, forecast_model
from .pricing import iteration_seconds, tf32_note
from .replay import ALLOCATORS, CHUNK_SIZE, fitting_budget, measure
from .result import Plan, PolicyResult
from .strategies import STRATEGIES, StrategyBook, compare

LINEAR_BATCHES = (2, 4)  # fitted
LINEAR_CHECK = 3  # checked at once; the chosen batches are checked at the end
SEARCH_CAP = 1 << 20  # the largest batch searched when max_batch is None
SEARCH_CAP_CAPTURED = 1 << 14  # ... when every probe is a capture


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"  [{time.perf_counter() - self.t0:5.1f} s] {msg}", file=sys.stderr, flush=True)


class _Traces:
    """The model's traces by batch size: captured once each, or scaled from a linear fit."""

    def __init__(self, capture_at: Callable[[int], Trace], say: _Progress) -> None:
        self.capture_at = capture_at
        self.say = say
        self.captured: dict[int, Trace] = {}
        self.linear: Optional[LinearTrace] = None

    def capture(self, n: int) -> Trace:
        if n not in self.captured:
            t0 = time.perf_counter()
            self.captured[n] = self.capture_at(n)
            self.say(f"captured batch {n}: {len(self.captured[n])} events in {time.perf_counter() - t0:.1f} s")
        return self.captured[n]

    def fit_linear(self) -> Optional[str]:
        """Tries the linear model; None if it holds at the check batch, else why not."""
        a, b = (self.capture(n) for n in LINEAR_BATCHES)
        lt = LinearTrace.fit(a, b)
        if lt is None:
            return f"the events at batch {LINEAR_BATCHES[0]} and {LINEAR_BATCHES[1]} differ"
        why = lt.check(self.capture(LINEAR_CHECK))
        if why is None:
            self.linear = lt
        return why

    def at(self, n: int) -> Trace:
        if n in self.captured:
            return self.captured[n]
        return self.linear.at(n) if self.linear is not None else self.capture(n)

    def verify(self, n: int) -> Optional[str]:
        """Captures batch ``n`` and compares it with the extrapolation (None: they agree)."""
        if self.linear is None or n in self.captured or n < 1:
            return None
        return self.linear.check(self.capture(n))


class _Evaluator:
    """Whether a batch fits, per policy, and at what speed; sequences cached per batch."""

    def __init__(self, traces: _Traces, dev: DeviceProfile, budget: int, allocator: Optional[str],
                 min_bytes: int) -> None:  # fmt: skip
        self.traces, self.dev, self.budget, self.allocator = traces, dev, budget, allocator
        self.min_bytes = min_bytes
        self.seqs: dict[int, Sequence] = {}

    def sequence(self, n: int) -> Sequence:
        if n not in self.seqs:  # every operator priced on the device (Note [Per-operator roofline])
            self.seqs[n] = sequence_from_trace(self.traces.at(n), cost=self.dev, min_bytes=self.min_bytes)
        return self.seqs[n]

    def compute_seconds(self, n: int) -> float:
        seq = self.sequence(n)
        if len(seq):
            return sum(seq.compute)
        return iteration_seconds(self.traces.at(n), self.dev)  # nothing to swap: the whole iteration

    def schedule(self, n: int, policy: str, budget: int) -> Scheduled:
        return schedule_for(self.sequence(n), budget, policy, self.dev.h2d_bandwidth, self.dev.d2h_bandwidth)

    def fits(self, n: int, policy: str) -> Optional[int]:
        """The budget the plan is made for if batch ``n`` fits under ``policy`` (lowered below the budget
        when the allocator needs room), else None."""
        seq = self.sequence(n)
        if self.allocator and self.allocator.startswith("vmalloc") and self.budget < CHUNK_SIZE:
            return None  # vmalloc maps whole chunks: an arena smaller than one holds nothing
        if policy == "none":
            if (seq.no_swap_peak() if len(seq) else live_peak(self.traces.at(n))) > self.budget:
                return None
            if self.allocator and not measure(self.traces.at(n), self.allocator, capacity=self.budget)["ok"]:
                return None
            return self.budget
        if len(seq) == 0:
            return self.fits(n, "none")
        if self.allocator is None:
            try:
                self.schedule(n, policy, self.budget)
            except InfeasibleBudget:
                return None
            return self.budget
        return fitting_budget(self.traces.at(n), self.allocator, self.budget,
                              lambda b: self.schedule(n, policy, b).schedule, self.min_bytes)  # fmt: skip

    def result(self, policy: str, n: int, plan_budget: Optional[int], trials: int) -> PolicyResult:
        r = PolicyResult(policy, n, trials=trials, plan_budget=plan_budget)
        if n == 0 or plan_budget is None:
            return r
        seq = self.sequence(n)
        if policy == "none" or len(seq) == 0:
            r.step_time = self.compute_seconds(n)
            r.stall_time = 0.0
            r.peak = seq.no_swap_peak() if len(seq) else None
        else:
            r.window, sched, sim = self.schedule(n, policy, plan_budget)
            r.step_time, r.stall_time, r.peak = sim.step_time, sim.stall_time, sched.peak
            r.swapped_bytes = sim.d2h_bytes
        r.samples_per_s = n / r.step_time if r.step_time else None
        return r


def _search(fits: Callable[[int], bool], guess: int, cap: int) -> tuple[int, int]:
    """The largest n in [1, cap] with fits(n) (0 if none), for a monotone ``fits``: gallops from ``guess``
    up or down, then bisects. Returns (n, trials)."""
    trials = 0

    def probe(n: int) -> bool:
        nonlocal trials
        trials += 1
        return fits(n)

    n = max(1, min(cap, guess))
    if probe(n):
        lo, hi = n, None
        while hi is None:
            if lo >= cap:
                return cap, trials
            step = min(cap, max(lo + 1, lo * 2))
            if probe(step):
                lo = step
            else:
                hi = step
    else:
        lo, hi = 0, n
        while lo == 0 and hi > 1:
            step = hi // 2
            if probe(step):
                lo = step
            else:
                hi = step
        if lo == 0:
            return 0, trials
    return largest_fitting(probe, lo, hi), trials


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Bisects between ``lo`` (fits, or 0) and ``hi`` (does not fit): the largest n < hi with fits(n), for a
    ``fits`` monotone in between."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _guess(ev: _Evaluator, policy: str) -> int:
    """Where to start searching: where the linear fit of the relevant peak (the no-swap peak, or the largest
    single step's working set) through two batches meets the budget."""
    a, b = LINEAR_BATCHES

    def need(n: int) -> float:
        seq = ev.sequence(n)
        if policy == "none" or not len(seq):
            return seq.no_swap_peak() if len(seq) else 0
        return seq.step_floor()

    na, nb = need(a), need(b)
    slope = (nb - na) / (b - a)
    if slope <= 0:
        return b
    return max(1, int((ev.budget - (na - slope * a)) / slope))


def plan(
    model_fn: Callable[[], torch.nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
    *,
    budget: Size,
    device: Union[str, DeviceProfile] = "h100-pcie",
    allocator: Optional[str] = "vmalloc",
    max_batch: Optional[int] = None,
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None,
    dtype: Optional[torch.dtype] = None,
    profile: Optional[str] = None,
    policies: tuple[str, ...] = ("none", "window", "fixed_distance", "all"),
    min_bytes: Size = "1MiB",
    steps: int = 2,
    target: str = "cuda",
    name: Optional[str] = None,
    progress: bool = True,
    strategies: tuple[str, ...] = STRATEGIES,
    batch: Optional[int] = None,
    world_size: int = 1,
    shard: Optional[str] = None,
    interconnect: Optional[Union[str, InterconnectProfile]] = None,
    model_state: Union[ModelStatePolicy, str, None] = None,
    host: Union[str, HostProfile, None] = None,
    tf32: Union[str, bool, None] = "auto",
) -> Plan:
    """The largest batch of your model that fits ``budget`` on ``device``, per swap policy, and its speed.

    Args:
        model_fn: ``model_fn()`` builds the model (it is called under ``torch.device("meta")``: no memory): a class
            or a function, not a model already built. The model must have parameters (a training step updates them).
        batch_fn: ``batch_fn(n)`` returns a batch of n samples: a dict (Hugging Face style, with labels) or an
            ``(input, target)`` pair, or what ``loss_fn`` takes. Tensors made with factory functions land on the
            meta device; others are moved there.
        loss_fn: ``loss_fn(model, batch) -> loss``. Default: ``model(**batch).loss`` for a dict batch,
            ``cross_entropy(model(x), y)`` for an ``(x, y)`` batch.
        budget: device memory for the run, bytes or a string such as "24GiB".
        device: a profile name (``swap.devices.PROFILES``: "h100-pcie", "a100-80gb", "rtx4090", ...) or a
            ``DeviceProfile``.
        allocator: "vmalloc", "pytorch_native", "pytorch_expandable", or None (ideal: no fragmentation).
        max_batch: the largest batch to consider (default: no limit but the budget).
        optimizer: ``optimizer(params) -> Optimizer`` (default AdamW).
        dtype: train the model in this dtype (e.g. ``torch.bfloat16``; its tensor-core peak is used).
        profile: a measured profile (``SwapManager.save_profile``) whose link bandwidths and step times replace
            the device's datasheet figures.
        policies: which swap policies to plan (default all: "none", "window", "fixed_distance", "all").
        min_bytes: saved tensors smaller than this stay on the device, as ``SwapManager(min_bytes=...)``.
        steps: training steps captured per batch size (default 2: the second has the optimizer state the first
            made, as a real loop's steady iterations do).
        target: whose kernels to mirror in the capture ("cuda", or "cpu" to compare with a CPU run).
        name: the model's name in the output and the traces (default: ``model_fn.__name__``).
        progress: log lines to stderr as it goes.
        strategies: which keep / swap / recompute strategies to compare side by side (default: every baseline
            of ``swap.joint.search.BASELINES`` and the joint strategy "auto"; ``()``: none).
        world_size, shard, interconnect: forecast one rank of ``world_size`` sharding the model with ``shard``
            ("fsdp2": ``fully_shard`` on each block and the root; "fsdp2-offload", or a
            ``swap.forecast.fsdp2_lanes.Offload``: with model-state offload), its collectives priced on ``interconnect``
            (``swap.devices.INTERCONNECTS``: "nvlink4", "ib-ndr400"; default "nvlink4"): the budget and every
            batch are per rank (Note [One rank of FSDP2] in swap/forecast/distributed.py).
        batch: also compare the strategies at this batch size (and forecast model state at it).
        model_state: plan parameters, gradients and optimizer state under the budget too, at ``batch``, as a
            ``swap.ModelStatePolicy`` says (the one ``SwapManager`` takes): its placement ("auto": chosen per
            bucket, resident, host master or streamed; or every bucket "streamed", "host_master" or
            "resident"), its ``bucket_bytes`` (None: the runtime's default for the weights and the budget) and
            ``host_memory`` (None: the host profile's) and ``compute_dtype`` (mixed precision of an fp32 model, as
            the runtime trains it: Note [Mixed precision pricing] in swap/forecast/offload.py), side by side with
            other systems' offload schedules (``swap.forecast.offload``); the result's ``model_state``. A
            placement string is the old spelling (a FutureWarning). None: model state stays on the device, unless
            nothing fits so (Note [Model-state offload unasked]).
        host: the host profile for ``model_state`` (``swap.devices.HOST_PROFILES``: "desktop-ddr5-2ch",
            "server-ddr5-8ch", or a file bench/host_profile.py wrote); giving one implies model_state="auto".
            None: where no batch fits, model-state offload is forecast on ``swap.devices.default_host``'s profile.
        tf32: which fp32 operators run on TF32 tensor cores (Note [Peaks by precision and kind] in
            swap/devices.py): "auto" (PyTorch's flags as they are now: convolutions by default, matmuls after
            ``torch.backends.cuda.matmul.allow_tf32 = True`` or ``set_float32_matmul_precision("high")``), "on"
            (True) both, "off" (False) neither.
    Returns:
        ``swap.Plan``: ``max_batch``, ``throughput``, ``window``, ``strategies``, ``table()``, ``plot(path)``,
        ``plot_strategies(path)``; where no batch fits (``fits_nothing``), ``min_budget``: the smallest budget in
        which batch 1 fits.
    Raises:
        swap.capture.CaptureError: the model's training step cannot run on the meta device (says which
            operator, where, and what to do).
        TypeError: an argument of the wrong kind (a built model as ``model_fn``, a string as ``policies``).
        ValueError: a value out of range, an unknown name, or a model without parameters.
    """
    t0 = time.perf_counter()
    say = _Progress(progress)
    budget = parse_size(budget, "budget", minimum=1)
    dev = with_tf32(device if isinstance(device, DeviceProfile) else device_profile(device), tf32)
    refuse_budget_above(budget, dev, device if isinstance(device, str) else "")
    if allocator in ("ideal", "none"):
        allocator = None
    if allocator is not None and allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}: choose one of {', '.join(ALLOCATORS)}, or None (ideal)")
    check_model_fn(model_fn)
    check_functions(batch_fn, loss_fn)
    policies = check_names(policies, "policies", "policy", POLICIES)
    strategies = check_names(strategies, "strategies", "strategy", STRATEGIES)
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, not {max_batch}")
    optimizer = with_parameters(optimizer)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be a positive int, not {batch!r}")
    min_bytes_ = parse_size(min_bytes, "min_bytes", none="0, as SwapManager: every saved tensor may move") or 0
    label = name or getattr(model_fn, "__name__", "model")
    ranks = distributed.sharding(model_fn, world_size, shard, interconnect, dtype)
    ms_policy = None if model_state is None else policy_of(model_state, "model_state")
    host_ = _model_state_host(ms_policy, host, batch, dtype)

    def capture_at(n: int) -> Trace:
        trace = capture(model_fn, batch_fn, n, loss_fn, optimizer=optimizer, steps=steps, target=target, dtype=dtype,
                        name=label)  # fmt: skip
        return distributed.rank_trace(trace, ranks) if ranks is not None else trace

    traces = _Traces(capture_at, say)
    notes = [tf32_note(dev, tf32)] if dev.tf32_flops and dtype in (None, torch.float32) else []
    say(f"planning {label} for a budget of {fmt_bytes(budget)} on {dev.name}")
    why = traces.fit_linear()
    if why is None:
        say(f"the trace is linear in the batch (fitted at {LINEAR_BATCHES}, checked at {LINEAR_CHECK}): scaling it")
    else:
        say(f"the trace is not linear in the batch ({why}): capturing every batch the search tries")
    dev = _calibrated(dev, profile, traces, min_bytes_, say, notes)
    cap = max_batch or (SEARCH_CAP if traces.linear is not None else SEARCH_CAP_CAPTURED)

    while True:
        ev, found = _search_all(traces, dev, budget, allocator, min_bytes_, policies, cap, say)
        wrong = [why for why in (traces.verify(n) for n, _, _ in found.values()) if why]
        compared = {}
        if strategies and not wrong:
            book = StrategyBook(traces.at, ev.sequence, dev, budget, min_bytes_)
            guess = found["none"][0] if "none" in found else _guess(ev, "none")
            compared = compare(book, strategies, lambda fits, g, cap=cap: _search(fits, g, cap), guess, batch, say)
            wrong = [why for why in (traces.verify(r.max_batch) for r in compared.values()) if why]
        if not wrong:
            break
        # The extrapolation was wrong at a largest batch (a policy's or a strategy's): search again on captures.
        note = f"the linear extrapolation failed a check ({wrong[0]}): planned again from per-batch captures"
        say(note)
        notes.append(note)
        traces.linear, cap = None, min(cap, SEARCH_CAP_CAPTURED)
    results = {p: ev.result(p, n, plan_budget, trials) for p, (n, plan_budget, trials) in found.items()}
    memory = _memory(ev, results.get("window"))
    result = Plan(label, budget, dev, allocator, results, memory=memory, linear=traces.linear is not None,
                  captures=sorted(traces.captured), notes=notes, strategies=compared, batch=batch)  # fmt: skip
    if policies and result.fits_nothing:
        result.min_budget, result.min_budget_policy = _smallest_budget(ev, policies, say)
    if ranks is not None:
        result = distributed.with_collectives(result, traces.at, ranks, dev)
    offload_batch = batch
    if host_ is None and model_state is None and ranks is None and result.fits_nothing:
        host_, offload_batch = host_profile(default_host(dev)), batch or 1  # Note [Model-state offload unasked]
        say(f"nothing fits with model state on the device: model-state offload at batch {offload_batch} on host "
            f"profile {default_host(dev)}")  # fmt: skip
    if host_ is not None:
        assert offload_batch is not None  # _model_state_host checked it
        result.model_state = forecast_model(
            model_fn, batch_fn, loss_fn, batch=offload_batch, budget=budget, dev=dev, host=host_,
            policy=ms_policy or ModelStatePolicy(), optimizer=optimizer, dtype=dtype, min_bytes=min_bytes_,
            target=target, name=label, say=say,
        )  # fmt: skip
        if host is None and model_state is None:
            result.notes.append(_offload_unasked(result.model_state, default_host(dev), offload_batch))
    result.seconds = time.perf_counter() - t0
    say(f"done in {result.seconds:.1f} s")
    return result


def _offload_unasked(f: Any, host: str, batch: int) -> str:
    """Note [Model-state offload unasked]: what the forecast with model state offloaded found, in words."""
    ours = f.results["ours"]
    where = (f"planned at batch {batch} on host profile {host} (the default for this device; host= or --host to "
             f"choose another, --at-batch for another batch)")  # fmt: skip
    if ours.fits:
        return (f"no batch fits with model state (parameters, gradients, optimizer state) on the device, but batch "
                f"{batch} fits with model state offloaded to the host: {ours.tokens_per_s:.0f} tokens/s "
                f"(simulated), {where}")  # fmt: skip
    return f"no batch fits with model state on the device, nor with it offloaded to the host ({ours.why}); {where}"


def _smallest_budget(ev: _Evaluator, policies: tuple[str, ...], say: _Progress) -> tuple[Optional[int], str]:
    """When no batch fits: the smallest budget (to within 1/256 of it) in which batch 1 fits under one of the
    policies planned, on the allocator, and that policy; (None, "") when not even the device's memory holds it.
    From the budget's floor (no schedule fits below the largest step floor), galloping up, then bisecting."""
    probe = _Evaluator(ev.traces, ev.dev, ev.budget, ev.allocator, ev.min_bytes)
    probe.seqs = ev.seqs

    def fitting(budget: int) -> str:
        probe.budget = budget
        return next((p for p in policies if probe.fits(1, p) is not None), "")

    seq = probe.sequence(1)
    floors = [seq.no_swap_peak() if p == "none" else min_budget(seq) for p in policies] if len(seq) else []
    lo = min(floors, default=live_peak(ev.traces.at(1))) - 1  # below every floor: does not fit
    if not fitting(ev.dev.memory):
        return None, ""
    hi, step = lo + 1, max(1 << 20, lo // 64)
    while not fitting(hi):
        lo, hi, step = hi, min(ev.dev.memory, hi + step), step * 2
    while hi - lo > max(1, hi >> 8):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fitting(mid) else (mid, hi)
    say(f"nothing fits: batch 1 fits from a budget of {fmt_bytes(hi)}")
    return hi, fitting(hi)


def _model_state_host(model_state: Optional[ModelStatePolicy], host: Union[str, HostProfile, None],
                      batch: Optional[int], dtype: Optional[torch.dtype] = None) -> Optional[HostProfile]:  # fmt: skip
    """The host profile ``swap.plan``'s model-state forecast runs on (None: no such forecast), or a ValueError
    saying what to pass (before any capture)."""
    if model_state is None and host is None:
        return None
    if model_state is not None and model_state.compute_dtype is not None:
        check_mixed(dtype, model_state)  # Note [Mixed precision pricing]: what the runtime refuses
    if host is None:
        raise ValueError(f"model_state={model_state!r} needs a host profile: host= one of {', '.join(HOST_PROFILES)}, "
                         "or a file bench/host_profile.py wrote")  # fmt: skip
    if batch is None:
        raise ValueError("model state is forecast at one batch: pass batch=N (--at-batch N)")
    profile = host_profile(host)
    if model_state is not None and model_state.host_memory is not None:  # the policy's cap on what model state takes
        profile = dataclasses.replace(profile, memory=model_state.host_memory)
    return profile


def _search_all(traces: _Traces, dev: DeviceProfile, budget: int, allocator: Optional[str], min_bytes: int,
                policies: tuple[str, ...], cap: int, say: _Progress,
                ) -> tuple[_Evaluator, dict[str, tuple[int, Optional[int], int]]]:  # fmt: skip
    """Per policy: (largest batch, the budget its plan is made for, batch sizes tried)."""
    ev = _Evaluator(traces, dev, budget, allocator, min_bytes)
    found: dict[str, tuple[int, Optional[int], int]] = {}
    for p in policies:
        budgets: dict[int, Optional[int]] = {}

        def fits(n: int, p: str = p, budgets: dict = budgets) -> bool:
            budgets[n] = ev.fits(n, p)
            return budgets[n] is not None

        t1 = time.perf_counter()
        n, trials = _search(fits, _guess(ev, p), cap)
        found[p] = (n, budgets.get(n), trials)
        say(f"{p}: largest batch {n} ({trials} batch sizes tried, {time.perf_counter() - t1:.1f} s)")
    return ev, found


def _calibrated(dev: DeviceProfile, path: Optional[str], traces: _Traces, min_bytes: int,
                say: _Progress, notes: list[str]) -> DeviceProfile:  # fmt: skip
    """The device with a measured profile's link bandwidths, and its compute scaled to the measured step
    time at the batch the profile ran (read from the file, or inferred from its saved bytes)."""
    if path is None:
        return dev
    m = read_measured(path)
    batch = m.batch
    if batch is None and traces.linear is not None and m.saved_bytes > 0:

        def saved(n: int) -> int:
            seq = sequence_from_trace(traces.at(n), min_bytes=min_bytes)
            return sum(seq.sizes)

        a, b = LINEAR_BATCHES
        slope = (saved(b) - saved(a)) / (b - a)
        guess = round((m.saved_bytes - (saved(a) - slope * a)) / slope) if slope > 0 else 0
        if guess >= 1 and abs(saved(guess) - m.saved_bytes) <= 0.05 * m.saved_bytes:
            batch = guess
            say(f"measured profile {path}: its {fmt_bytes(m.saved_bytes)} of saved activations match batch {batch}")
    roofline = None
    if batch:
        unit = dataclasses.replace(dev, efficiency=1.0, op_overhead=0.0)  # the roofline at full efficiency
        roofline = iteration_seconds(traces.at(int(batch)), unit)
    else:
        notes.append(f"{path} does not say its batch size and none matched its saved bytes: only its link "
                     "bandwidths are used; compute stays on the datasheet roofline")  # fmt: skip
    out = with_measured(dev, m, roofline)
    if roofline:
        notes.append(f"compute calibrated to {path} (batch {batch}): efficiency {out.efficiency:.2f}")
    say(f"device figures from {path}: H2D {out.h2d_bandwidth / 1e9:.1f} GB/s, D2H {out.d2h_bandwidth / 1e9:.1f} GB/s, "
        f"efficiency {out.efficiency:.2f}")  # fmt: skip
    return out


def _memory(ev: _Evaluator, r: Optional[PolicyResult]) -> dict[str, Any]:
    """Device bytes per access step, unswapped and swapped, at the window policy's largest batch."""
    if r is None or not r.max_batch or r.plan_budget is None:
        return {}
    seq = ev.sequence(r.max_batch)
    if not len(seq):
        return {}
    unswapped = [a + b for a, b in zip(seq.nonswap, seq.live_bytes())]
    sched = make_schedule(seq, r.plan_budget, r.window, "window")
    swapped = [a + b for a, b in zip(seq.nonswap, sched.resident)]
    backward = next((i for i, k in enumerate(seq.kind) if k == "use"), None)
    return {"batch": r.max_batch, "unswapped": unswapped, "swapped": swapped, "backward_starts": backward}


__all__ = ["CaptureError", "plan"]
