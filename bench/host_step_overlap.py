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

Predicted from what the runtime measures or plans (no figure of the speculative run itself):
- host-step seconds: torch's fused AdamW over the model's parameters, one call a bucket, on the host worker with
  nothing else of ours running (measured here, as a profile of the host would), plus the rollback copies
  (master and state, ``host_memory.predict``'s ``rollback``) at the copy rate measured here;
- hidden seconds: the host worker simulated first in, first out over the buckets in the order their gradients
  became final in today's run's backward (hooks timing each gradient's arrival) and the backward's length; what
  the worker has left when the next forward starts (backward end plus the loop's gap to the next forward, also
  measured) is exposed: the next forward's first bucket (the embedding's) is the last one the backward finishes;
- host bytes: the runtime's prediction before allocating (``host_bytes_predicted``) plus the rollback copies'.

Writes <out>/host_step_overlap.json and host_step_overlap.md. Wall clock; the machine is shared: the load
(``os.getloadavg``) is reported with the figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import swap
from bench.write import write_results
from swap.forecast import zoo

ROOT = Path(__file__).resolve().parents[1]
SKIP = 3  # the manager profiles the first steps and re-packs its buckets after the first backward


class Setup:
    def __init__(self, quick: bool, rounds: int) -> None:
        self.layers, self.d, self.vocab, self.seq, self.batch = (2, 128, 512, 16, 2) if quick else (4, 256, 1024, 16, 1)
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


def train(s: Setup, speculate: bool) -> dict[str, Any]:
    gc.collect()
    model = s.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    arrivals: list[tuple[int, float]] = []  # (id of the parameter, seconds) of this backward's gradients
    clock = [0.0]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrivals.append((id(p), time.perf_counter())))
             for p in model.parameters()]  # fmt: skip
    sm = swap.SwapManager(budget="1GiB", device="cpu", policy="window", model=model, optimizer=opt,
                          model_state="offload", bucket_bytes=s.bucket)  # fmt: skip
    rt = sm.model_state
    rt.speculate = speculate
    out: dict[str, Any] = {"backward": [], "gap": [], "wall": [], "final": []}
    last_end = None
    with sm:
        for step in range(s.steps):
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


def copy_rate(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a copy into a buffer made before (as the rollback copies are: read and written once), at the
    host step's thread count, on a thread of its own."""
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.zeros_like(src)
    from swap.runtime.model_state.host_optim import host_worker

    worker, _ = host_worker(torch.device("cpu"))
    try:
        def timed() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

        worker.submit(timed).result()
        seconds = statistics.median(worker.submit(timed).result() for _ in range(repeats))
    finally:
        worker.shutdown()
    return src.nbytes / seconds


def host_step_seconds(n_params: int, buckets: int, repeats: int = 5) -> float:
    """Seconds of torch's fused AdamW over ``n_params`` fp32 parameters in ``buckets`` calls (one a bucket, as the
    host step makes them), on the host step's worker with its threads, nothing else of ours running: the rate the
    runtime's host step has where nothing competes with it."""
    from swap.runtime.model_state.host_optim import host_worker

    per = max(n_params // buckets, 1)
    params = [torch.nn.Parameter(torch.ones(per)) for _ in range(buckets)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    groups = opt.param_groups[0]
    worker, _ = host_worker(torch.device("cpu"))

    def timed() -> float:
        t0 = time.perf_counter()
        for p in params:  # one call a bucket
            groups["params"] = [p]
            opt.step()
        groups["params"] = params
        return time.perf_counter() - t0

    try:
        worker.submit(timed).result()  # the state's allocation is not the cost
        return statistics.median(worker.submit(timed).result() for _ in range(repeats))
    finally:
        worker.shutdown()


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


def predict(today: dict[str, Any], step_seconds: float, rate: float) -> dict[str, float]:
    """The speculative run's host seconds, hidden seconds and host bytes (module docstring): the host step alone
    (``step_seconds``), the rollback copies at ``rate``, the gradients' timing from today's run."""
    ms = today["report"]
    specs = ms["bucket_specs"]
    weights = {b: spec["weight_bytes"] for b, spec in enumerate(specs)}
    total_w = sum(weights.values())
    rollback = ms["speculation"]["rollback_bytes_predicted"]
    # each bucket's share of the step and of the copies, by its weights' bytes
    host = {b: (step_seconds + rollback / rate) * w / total_w for b, w in weights.items()}
    final = {b: statistics.median(f.get(b, 0.0) for f in today["final"][SKIP:]) for b in weights}
    seconds, exposed = simulate(final, host, statistics.median(today["backward"][SKIP:]),
                                statistics.median(today["gap"][SKIP - 1:]))  # fmt: skip
    return {"host_step_seconds": seconds, "exposed_seconds": exposed, "hidden_seconds": seconds - exposed,
            "host_bytes": ms["host_bytes_predicted"] + rollback}  # fmt: skip


def measure(s: Setup) -> dict[str, Any]:
    torch.set_num_threads(1)  # one compute thread; the host step's worker gets the rest (Note [Host threads])
    load = [os.getloadavg()[0]]
    rounds = []
    for r in range(s.rounds):
        if r % 2:  # alternated: the first run of a pair has been the slower one on this shared machine
            spec = train(s, speculate=True)
            today = train(s, speculate=False)
        else:
            today = train(s, speculate=False)
            spec = train(s, speculate=True)
        bitwise = all(a.tobytes() == b.tobytes() for a, b in zip(today["params"], spec["params"]))
        rate = copy_rate(spec["report"]["speculation"]["rollback_bytes_predicted"])
        alone = host_step_seconds(today["n_params"], today["report"]["buckets"])
        pred = predict(today, alone, rate)
        got = summary(spec)
        ms = spec["report"]
        rounds.append({
            "today": summary(today), "speculative": got, "predicted": pred, "copy_rate_bytes_per_s": rate,
            "host_step_alone_seconds": alone,
            "bitwise": bitwise, "speculation": ms["speculation"],
            "host_bytes": ms["host_bytes"] + ms["speculation"]["rollback_bytes_peak"],
            "host_step_over_backward": summary(today)["host_step_seconds"] / summary(today)["backward_seconds"],
        })  # fmt: skip
        load.append(os.getloadavg()[0])
        print(f"round {r}: {rounds[-1]}", flush=True)
    return {"model": s.describe(), "parameters": today["n_params"], "buckets": today["report"]["buckets"],
            "host_threads": today["report"]["host_threads"], "compute_threads": 1, "rounds": rounds,
            "load_average_1min": load, "cores": os.cpu_count()}  # fmt: skip


def _err(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.1f} %" if b else "-"


def markdown(res: dict[str, Any], command: str) -> str:
    lines = [
        "# The host step hidden behind the backward (measured on this machine's CPU)",
        "",
        f"- command: `{command}`; torch {torch.__version__}, {res['cores']} cores, {platform.platform()}",
        f"- {res['model']}: {res['parameters'] / 1e6:.2f} M parameters in {res['buckets']} buckets; "
        f"{res['compute_threads']} compute thread, {res['host_threads']} host-step thread(s)",
        f"- load average (1 min) before and after each round: {', '.join(f'{x:.1f}' for x in res['load_average_1min'])}"
        f" on {res['cores']} cores (other jobs share the machine)",
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
    lines += ["", "Predicted before the speculative run (module docstring) against measured in it:", "",
              "| round | host-step s: predicted, measured, error | hidden s: predicted, measured, error | "
              "host bytes: predicted, measured, error |", "|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(res["rounds"]):
        p, g = r["predicted"], r["speculative"]
        lines.append(
            f"| {i} | {p['host_step_seconds'] * 1e3:.1f} ms, {g['host_step_seconds'] * 1e3:.1f} ms, "
            f"{_err(p['host_step_seconds'], g['host_step_seconds'])} | {p['hidden_seconds'] * 1e3:.1f} ms, "
            f"{g['hidden_seconds'] * 1e3:.1f} ms, {_err(p['hidden_seconds'], g['hidden_seconds'])} | "
            f"{p['host_bytes'] / 2**20:.2f} MiB, {r['host_bytes'] / 2**20:.2f} MiB, "
            f"{_err(p['host_bytes'], r['host_bytes'])} |"
        )
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
