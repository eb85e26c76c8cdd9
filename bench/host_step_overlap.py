"""The host step hidden behind the backward (Note [Speculative host steps]), measured for real on CPU.

    python -m bench.host_step_overlap            # about five minutes on 2 shared cores
    python -m bench.host_step_overlap --quick    # a smoke run

A GPT-style model small enough per token that its host step (fused AdamW over every parameter, on the host
worker) is at least a third of the backward, trained with every bucket offloaded, one compute thread (the main
thread's intra-op threads: 1) and the other cores for the host step (Note [Host threads]). Two runs of the same
seed, in pairs (``--rounds``; which runs first alternates): today's runtime (``speculate = False``: the host steps after
``opt.step()``, behind the next forward) and speculation (the default). For each: the host step's seconds, the
part something waited for (exposed) and the rest (hidden), over the steps after the manager planned; the two runs
must end bitwise equal.

Predicted from what the runtime measures or plans, and a rate measured in this process right before each run
(no figure of the run itself; Note [Measuring the host step where it runs] in bench/host_profile.py):
- host-step seconds: each bucket's ``host_step_bytes`` over the host step's rate (``price``: the forecast's pricing,
  ``HostProfile.step_seconds`` as ``swap.forecast.offload.prices_for`` calls it, at the kernel the runtime reports
  it ran). The rate: ``bench.host_profile.optimizer_rate`` over the runtime's buckets' sizes, one task a bucket on
  a host worker like the runtime's (its thread count), measured right before the run it prices (the load of a
  shared machine moves from minute to minute). For the speculative run each task makes the bucket's rollback
  copies first (``speculation.save``, as the runtime does) and is queued when that bucket's gradients became
  final in the last run of today's runtime, the main thread idle; for today's runtime all are queued at once (as
  at ``opt.step()``) while the main thread runs the model's forward (the next forward, which that host step runs
  beside: its Python holds the GIL each optimizer call needs). Both rates are measured both ways ("beside
  compute": the main thread running the model's backward, resp. forward; "alone": idle) and recorded; which one
  prices each run is Note [Which calibration prices which run];
- hidden seconds: the host worker simulated first in, first out over the buckets in the order their gradients
  became final in today's run's backward (hooks timing each gradient's arrival) and the backward's length; what
  the worker has left when the next forward starts (backward end plus the loop's gap to the next forward, also
  measured) is exposed: the next forward's first bucket (the embedding's) is the last one the backward finishes;
- host bytes: the runtime's prediction before allocating (``host_bytes_predicted``) plus the rollback copies'.

Note [Which calibration prices which run]
Measured on this machine (2 cores, other jobs at a load of 8-15): bench/results/host_step_overlap.md (9 rounds),
which prints both calibrations' errors for every round, and two earlier runs of 5 rounds (not kept). Today's
runtime's host step ran two to three times as long in the run as alone (the forward beside it takes cores and
the GIL each optimizer call needs): priced beside the forward, the medians -4 % (+11 %, +11 % in the earlier
runs); alone, -68 % (-61 %). The speculative host step priced alone: -8 % (+6 %, +15 %); priced beside a loop
of the model's plain backward: +79 % (+117 %, +90 %). The run's backward, inside the manager, takes less from
the host step than a bare backward run without a pause; why is not known (a guess: the manager's backward waits
on its own copies and hooks, and the host worker runs in those gaps). So the speculative run is priced alone,
today's beside the forward. Round to round the measured host step itself moves by up to 2x on this machine at
an equal load average, so one round's error says little; the medians are the figures.

Writes <out>/host_step_overlap.json and host_step_overlap.md. Wall clock; the machine is shared: the load
(``os.getloadavg``) is reported with the figures, per round, and the errors' medians over the rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

import swap
from bench import host_profile
from bench.write import write_results
from swap.devices import HostProfile
from swap.forecast import zoo
from swap.runtime.model_state.host_optim import host_worker

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.15  # issue 37, item 6: predicted within 15 %
SKIP = 3  # the manager profiles the first steps and re-packs its buckets after the first backward


class Setup:
    def __init__(self, quick: bool, rounds: int) -> None:
        self.layers, self.d, self.vocab, self.seq, self.batch = (2, 128, 512, 16, 2) if quick else (4, 512, 1024, 16, 1)
        self.steps = 6 if quick else 14
        self.bucket = "256KiB" if quick else "1MiB"
        self.rounds = rounds

    def describe(self) -> str:
        return (f"GPT ({self.layers} layers, d={self.d}, vocab {self.vocab}, seq {self.seq}, batch {self.batch}), "
                f"default AdamW (the host runs torch's fused kernel), every bucket offloaded "
                f"(bucket_bytes={self.bucket})")  # fmt: skip

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return zoo.gpt(n_layer=self.layers, n_head=4, d_model=self.d, vocab=self.vocab, seq_len=self.seq)

    def tokens(self, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=torch.Generator().manual_seed(it))
        return t[:, :-1], t[:, 1:]


def train(s: Setup, speculate: bool, steps: Optional[int] = None) -> dict[str, Any]:
    gc.collect()
    model = s.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    arrivals: list[tuple[int, float]] = []  # (id of the parameter, seconds) of this backward's gradients
    clock = [0.0]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrivals.append((id(p), time.perf_counter())))
             for p in model.parameters()]  # fmt: skip
    sm = swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                          model_state=swap.ModelStatePolicy(placement="streamed", bucket_bytes=s.bucket))  # fmt: skip
    rt = sm.model_state
    rt.speculate = speculate
    out: dict[str, Any] = {"backward": [], "gap": [], "wall": [], "final": []}
    last_end = None
    with sm:
        for step in range(s.steps if steps is None else steps):
            t0 = time.perf_counter()
            if last_end is not None:
                out["gap"].append(t0 - last_end)
            opt.zero_grad()
            x, y = s.tokens(step)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            arrivals.clear()
            clock[0] = b0 = time.perf_counter()
            loss.backward()
            b1 = last_end = time.perf_counter()
            out["backward"].append(b1 - b0)
            # when each bucket's gradients were all in, from the backward's start
            s_ = rt.streamer
            index = {id(p): s_.bucket_of[e.index] for e in rt.entries for _, p in e.params}
            final: dict[int, float] = {}
            for k, t in arrivals:
                final[index[k]] = max(final.get(index[k], 0.0), t - b0)
            out["final"].append(final)
            loss.item()
            opt.step()
            out["wall"].append(time.perf_counter() - t0)
        out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    for h in hooks:
        h.remove()
    ms = sm.report()["model_state"]
    out["report"] = ms
    out["n_params"] = sum(p.numel() for p in model.parameters())
    return out


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["step"] > SKIP]


def host_rate(s: Setup, numels: list[int], kernel: str, arrivals: Optional[list[float]], beside: bool) -> float:
    """Bytes/s of DRAM traffic of the runtime's host step over buckets of ``numels``, on a host worker like the
    runtime's, one task a bucket: Note [Measuring the host step where it runs]. Speculative (``arrivals``: when
    each bucket's gradients became final, from the backward's start): each with its rollback copies first, queued
    at its arrival, this thread running the model's backward meanwhile (again and again over one graph); today's
    runtime's (None): all queued at once, as at ``opt.step()``, this thread running the model's forward (the next
    one, which today's host step runs beside). ``beside`` False: this thread idle instead."""
    model = s.build()
    x, y = s.tokens(0)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def backward() -> None:
        loss.backward(retain_graph=True)
        model.zero_grad(set_to_none=True)

    def forward() -> None:
        model(x)

    worker, _ = host_worker(torch.device("cpu"))
    try:
        make = host_profile.variants("adamw")[kernel]
        busy = (forward if arrivals is None else backward) if beside else None
        return host_profile.optimizer_rate(make, "adamw", numels, save=arrivals is not None, worker=worker,
                                           beside=busy, arrivals=arrivals, repeats=5)  # fmt: skip
    finally:
        worker.shutdown()


def price(numels: list[int], rate: float, kernel: str = "fused") -> list[float]:
    """Each bucket's host-step seconds at ``rate`` bytes/s of DRAM traffic for ``kernel``: the forecast's pricing
    (``HostProfile.step_seconds``, fp32 master and gradient, as ``swap.forecast.offload.prices_for`` prices an fp32
    model's host step) with the measured rate as the profile's."""
    host = HostProfile("measured right before the run", rate, {f"adamw:{kernel}": rate}, 0, 0)
    return [host.step_seconds("adamw", n, 4, 4, kernel=kernel) for n in numels]


def simulate(final: dict[int, float], host: dict[int, float], backward: float, gap: float) -> tuple[float, float]:
    """(host seconds, exposed seconds) of speculative host steps: each bucket's queued when its gradients are all
    in (``final``: seconds from the backward's start), run first in, first out, ``host[b]`` seconds each; the next
    forward starts ``gap`` after the backward's end and waits for whatever the worker still has."""
    free = 0.0
    for b in sorted(final, key=final.get):
        free = max(free, final[b]) + host[b]
    return sum(host.values()), max(0.0, free - backward - gap)


def summary(run: dict[str, Any]) -> dict[str, float]:
    rows = steady(run["report"]["steps"])
    host = sum(r["host_step_seconds"] for r in rows)
    exposed = sum(min(r["host_step_exposed_seconds"], r["host_step_seconds"]) for r in rows)
    n = len(rows)
    return {"steps": n, "host_step_seconds": host / n, "exposed_seconds": exposed / n,
            "hidden_seconds": (host - exposed) / n, "hidden_fraction": (host - exposed) / host if host else 0.0,
            "backward_seconds": statistics.median(run["backward"][SKIP:]),
            "step_seconds": statistics.median(run["wall"][SKIP:])}  # fmt: skip


def numels_of(report: dict[str, Any]) -> list[int]:
    """The runtime's buckets' sizes (elements), in its order."""
    return [spec["numel"] for spec in report["bucket_specs"]]


def predict(today: dict[str, Any], rate: float, kernel: str) -> dict[str, float]:
    """The speculative run's host seconds, hidden seconds and host bytes (module docstring): the buckets priced at
    ``rate`` (the speculative step's, measured before the run), the gradients' timing from today's run."""
    ms = today["report"]
    host = dict(enumerate(price(numels_of(ms), rate, kernel)))
    final = {b: statistics.median(f.get(b, 0.0) for f in today["final"][SKIP:]) for b in host}
    seconds, exposed = simulate(final, host, statistics.median(today["backward"][SKIP:]),
                                statistics.median(today["gap"][SKIP - 1:]))  # fmt: skip
    rollback = ms["speculation"]["rollback_bytes_predicted"]
    return {"host_step_seconds": seconds, "exposed_seconds": exposed, "hidden_seconds": seconds - exposed,
            "host_bytes": ms["host_bytes_predicted"] + rollback}  # fmt: skip


def rates(s: Setup, numels: list[int], kernel: str, arrivals: Optional[list[float]]) -> dict[str, float]:
    """The host step's rate right before a run (``arrivals``: the speculative run's), beside the compute and alone
    (Note [Which calibration prices which run])."""
    return {"beside_compute": host_rate(s, numels, kernel, arrivals, beside=True),
            "alone": host_rate(s, numels, kernel, arrivals, beside=False)}  # fmt: skip


def arrival_order(run: dict[str, Any], numels: list[int]) -> tuple[list[int], list[float]]:
    """The buckets' sizes in the order their gradients became final in ``run``'s backward, and when (medians over
    its steps after the first ``SKIP``, seconds from the backward's start)."""
    final = {b: statistics.median(f.get(b, 0.0) for f in run["final"][SKIP:]) for b in range(len(numels))}
    order = sorted(final, key=final.get)
    return [numels[b] for b in order], [final[b] for b in order]


def measure(s: Setup) -> dict[str, Any]:
    torch.set_num_threads(1)  # one compute thread; the host step's worker gets the rest (Note [Host threads])
    # the runtime's buckets and kernel, from a short run before the rounds (the same model packs the same)
    probe = train(s, speculate=False, steps=SKIP + 3)
    numels, kernel = numels_of(probe["report"]), probe["report"]["host_kernel"]
    ordered, arrivals = arrival_order(probe, numels)  # updated from each round's run of today's runtime
    load = []
    rounds = []
    for r in range(s.rounds):
        before = os.getloadavg()[0]
        runs: dict[str, Any] = {}
        measured: dict[str, dict[str, float]] = {}
        # alternated: the first run of a pair has been the slower one on this shared machine
        for speculate in (True, False) if r % 2 else (False, True):
            name = "speculative" if speculate else "today"
            # right before the run it prices
            measured[name] = rates(s, ordered, kernel, arrivals) if speculate else rates(s, numels, kernel, None)
            runs[name] = train(s, speculate=speculate)
            if not speculate:
                ordered, arrivals = arrival_order(runs[name], numels)
        today, spec = runs["today"], runs["speculative"]
        bitwise = all(a.tobytes() == b.tobytes() for a, b in zip(today["params"], spec["params"]))
        pred = predict(today, measured["speculative"]["alone"], kernel)  # Note [Which calibration prices which run]
        got = summary(spec)
        ms = spec["report"]
        load.append((before, os.getloadavg()[0]))
        rounds.append({
            "today": summary(today), "speculative": got, "predicted": pred, "rates_bytes_per_s": measured,
            "today_predicted_host_step_seconds": sum(price(numels, measured["today"]["beside_compute"], kernel)),
            "bitwise": bitwise, "speculation": ms["speculation"],
            "host_bytes": ms["host_bytes"] + ms["speculation"]["rollback_bytes_peak"],
            "host_step_over_backward": summary(today)["host_step_seconds"] / summary(today)["backward_seconds"],
            "load_average_1min": load[-1],
        })  # fmt: skip
        print(f"round {r}: {rounds[-1]}", flush=True)
    return {"model": s.describe(), "parameters": today["n_params"], "buckets": today["report"]["buckets"],
            "numels": numels, "host_kernel": kernel, "host_threads": today["report"]["host_threads"],
            "compute_threads": 1, "rounds": rounds, "load_average_1min": load, "cores": os.cpu_count()}  # fmt: skip


def _err(a: float, b: float) -> float:
    return (a - b) / b if b else float("nan")


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def errors(res: dict[str, Any]) -> dict[str, list[float]]:
    """Per round, predicted over measured minus one: the speculative run's host-step seconds, hidden seconds and
    host bytes, and today's run's host-step seconds."""
    out: dict[str, list[float]] = {"host_step_seconds": [], "hidden_seconds": [], "host_bytes": [], "today_host": []}
    for r in res["rounds"]:
        p, g = r["predicted"], r["speculative"]
        out["host_step_seconds"].append(_err(p["host_step_seconds"], g["host_step_seconds"]))
        out["hidden_seconds"].append(_err(p["hidden_seconds"], g["hidden_seconds"]))
        out["host_bytes"].append(_err(p["host_bytes"], r["host_bytes"]))
        out["today_host"].append(_err(r["today_predicted_host_step_seconds"], r["today"]["host_step_seconds"]))
    return out


def markdown(res: dict[str, Any], command: str) -> str:
    gb = 1e9
    lines = [
        "# The host step hidden behind the backward (measured on this machine's CPU)",
        "",
        f"- command: `{command}`; torch {torch.__version__}, {res['cores']} cores, {platform.platform()}",
        f"- {res['model']}: {res['parameters'] / 1e6:.2f} M parameters in {res['buckets']} buckets; "
        f"{res['compute_threads']} compute thread, {res['host_threads']} host-step thread(s), the "
        f"{res['host_kernel']} kernel",
        "- load average (1 min) before and after each round: "
        + "; ".join(f"{a:.1f}, {b:.1f}" for a, b in res["load_average_1min"])
        + f" on {res['cores']} cores (other jobs share the machine)",
        f"- per optimizer step, averaged over the steps after the first {SKIP} (the manager profiles and re-packs)",
        "",
        "| round | host step / backward (today) | today: host s, hidden | speculative: host s, hidden | "
        "kept / speculated | bitwise |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(res["rounds"]):
        t, g = r["today"], r["speculative"]
        lines.append(f"| {i} | {r['host_step_over_backward']:.2f} | {t['host_step_seconds'] * 1e3:.1f} ms, "
                     f"{100 * t['hidden_fraction']:.0f} % | {g['host_step_seconds'] * 1e3:.1f} ms, "
                     f"{100 * g['hidden_fraction']:.0f} % | {r['speculation']['kept']} / "
                     f"{r['speculation']['speculated']} | {r['bitwise']} |")  # fmt: skip
    med = {k: statistics.median(v) for k, v in errors(res).items()}
    lines += ["", "Predicted against measured in the speculative run: the host step priced at the rate measured right "
              "before it, alone (module docstring; Note [Measuring the host step where it runs] in "
              "bench/host_profile.py; Note [Which calibration prices which run] in bench/host_step_overlap.py), the "
              "hidden seconds from today's run's gradient timing (same round):", "",
              "| round | host-step s: predicted, measured, error | hidden s: predicted, measured, error | "
              "host bytes: predicted, measured, error |", "|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(res["rounds"]):
        p, g = r["predicted"], r["speculative"]
        lines.append(
            f"| {i} | {p['host_step_seconds'] * 1e3:.1f} ms, {g['host_step_seconds'] * 1e3:.1f} ms, "
            f"{_pct(_err(p['host_step_seconds'], g['host_step_seconds']))} | {p['hidden_seconds'] * 1e3:.1f} ms, "
            f"{g['hidden_seconds'] * 1e3:.1f} ms, {_pct(_err(p['hidden_seconds'], g['hidden_seconds']))} | "
            f"{p['host_bytes'] / 2**20:.2f} MiB, {r['host_bytes'] / 2**20:.2f} MiB, "
            f"{_pct(_err(p['host_bytes'], r['host_bytes']))} |"
        )
    lines.append(f"| median | {_pct(med['host_step_seconds'])} | {_pct(med['hidden_seconds'])} | "
                 f"{_pct(med['host_bytes'])} |")  # fmt: skip
    lines += ["", "The rates (GB/s of the host step's DRAM traffic, `host_step_bytes` over its seconds) measured "
              "right before each run (the speculative run priced at its rate alone, today's at its rate beside "
              "the forward), and today's run's host step priced so:", "",
              "| round | speculative: beside compute, alone | today: beside compute, alone | today host s: "
              "predicted, measured, error |", "|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(res["rounds"]):
        m, t = r["rates_bytes_per_s"], r["today"]["host_step_seconds"]
        p = r["today_predicted_host_step_seconds"]
        lines.append(f"| {i} | {m['speculative']['beside_compute'] / gb:.2f}, {m['speculative']['alone'] / gb:.2f} | "
                     f"{m['today']['beside_compute'] / gb:.2f}, {m['today']['alone'] / gb:.2f} | {p * 1e3:.1f} ms, "
                     f"{t * 1e3:.1f} ms, {_pct(_err(p, t))} |")  # fmt: skip
    lines.append(f"| median | | | {_pct(med['today_host'])} |")
    other = {"speculative": [], "today": []}  # the host-step seconds priced by the other calibration
    for r in res["rounds"]:
        m = r["rates_bytes_per_s"]
        for run, rate in (("speculative", m["speculative"]["beside_compute"]), ("today", m["today"]["alone"])):
            other[run].append(_err(sum(price(res["numels"], rate, res["host_kernel"])), r[run]["host_step_seconds"]))
    spec_other = ", ".join(_pct(e) for e in other["speculative"])
    today_other = ", ".join(_pct(e) for e in other["today"])
    lines += ["", "Priced by the other calibration (Note [Which calibration prices which run]), the host-step "
              f"seconds' errors: the speculative run beside the backward {spec_other} (median "
              f"{_pct(statistics.median(other['speculative']))}); today's alone {today_other} (median "
              f"{_pct(statistics.median(other['today']))})"]  # fmt: skip
    spec_hidden = [r["speculative"]["hidden_fraction"] for r in res["rounds"]]
    today_hidden = [r["today"]["hidden_fraction"] for r in res["rounds"]]
    ratio = [r["host_step_over_backward"] for r in res["rounds"]]
    within = {k: sum(abs(e) <= TARGET for e in v) for k, v in errors(res).items()}
    n = len(res["rounds"])
    lines += ["", "Issue 37, item 6, on this run:", "",
              f"- host step / backward (today's run): {', '.join(f'{x:.2f}' for x in ratio)} (target: at least "
              f"1/3; median {statistics.median(ratio):.2f})",
              f"- hidden with speculation: {', '.join(f'{100 * x:.0f} %' for x in spec_hidden)} (median "
              f"{100 * statistics.median(spec_hidden):.0f} %; target: at least 80 %), against today's runtime "
              f"on the same rounds: {', '.join(f'{100 * x:.0f} %' for x in today_hidden)} (median "
              f"{100 * statistics.median(today_hidden):.0f} %)",
              f"- within {100 * TARGET:.0f} % of the measurement (rounds of {n}): host-step seconds "
              f"{within['host_step_seconds']}, hidden seconds {within['hidden_seconds']}, host bytes "
              f"{within['host_bytes']}; the medians: {_pct(med['host_step_seconds'])}, "
              f"{_pct(med['hidden_seconds'])}, {_pct(med['host_bytes'])}"]  # fmt: skip
    lines += ["", "Step wall time (median, ms): " + ", ".join(
        f"round {i}: today {r['today']['step_seconds'] * 1e3:.0f}, "
        f"speculative {r['speculative']['step_seconds'] * 1e3:.0f}"
        for i, r in enumerate(res["rounds"])), ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    s = Setup(args.quick, args.rounds)
    res = measure(s)
    command = "python -m bench.host_step_overlap" + (" --quick" if args.quick else "")
    if args.rounds != 3:
        command += f" --rounds {args.rounds}"
    stem = "host_step_overlap" + ("_quick" if args.quick else "")
    write_results(args.out, stem, res, markdown(res, command))


if __name__ == "__main__":
    main()
