"""The workloads of ``bench.strategies`` and the strategy targets on them, checked on ``swap.plan``'s
strategies. ``check`` is pure: it reads the compared strategies only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from swap.capture import ALLOC, OP, TAG, capture
from swap.forecast.strategies import StrategyResult


@dataclass(frozen=True)
class Workload:
    key: str
    name: str
    model: str  # a swap.forecast.zoo name, or "hf-gpt2-medium"
    device: str
    budget: str
    optimizer: str  # "adamw" or "sgd"
    keep_at_5x: Optional[float]  # the share of no-swap samples/s the joint strategy must keep at 5x
    largest: str  # "10x or the wall", "window's at 50 %", "10x at 60 %"


WORKLOADS = (
    Workload("gpt2-medium-h100", "GPT-2 medium bf16, 1024 tokens, AdamW (built-in, SDPA)", "gpt2-medium-bf16",
             "h100-sxm", "80GiB", "adamw", 0.85, "10x or the wall"),
    Workload("hf-gpt2-medium-h100", "GPT-2 medium bf16, 1024 tokens, AdamW (HF GPT2LMHeadModel, SDPA)",
             "hf-gpt2-medium", "h100-sxm", "80GiB", "adamw", 0.85, "10x or the wall"),
    Workload("resnet50-h100", "ResNet-50 224x224 fp32, SGD", "resnet50", "h100-sxm", "80GiB", "sgd", 0.70,
             "window's at 50 %"),
    Workload("resnet50-v100", "ResNet-50 224x224 fp32, SGD", "resnet50", "v100-16gb", "16GiB", "sgd", None,
             "10x at 60 %"),
)  # fmt: skip


def kept(s: dict[str, StrategyResult], n: int, name: str = "auto") -> float:
    """``name``'s samples/s at batch ``n`` over the no-swap samples/s at its largest batch (0 where it does not
    fit)."""
    p, base = s[name].at(n), s["none"].at_max
    if p is None or not p.fits or base is None or not base.samples_per_s:
        return 0.0
    return p.samples_per_s / base.samples_per_s


def _costs(s: dict[str, StrategyResult], n: int) -> str:
    """Where the joint strategy's step goes at batch ``n``: compute, recompute, stalls on the link."""
    p = s["auto"].at(n)
    if p is None or not p.fits:
        return ""
    base = s["none"].at_max
    compute = base.step_time * n / base.batch if base is not None and base.step_time else 0.0
    return (f"step {p.step_time:.3g} s: compute {compute:.3g} s, recompute {p.recompute_seconds:.3g} s, stalls on "
            f"the link {p.stall_time:.3g} s ({p.copied_bytes / 2**30:.1f} GiB copied); plan: {p.plan}")  # fmt: skip


def check(w: Workload, s: dict[str, StrategyResult], wall: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The strategy targets for ``w``: each {target, met, detail}."""
    out = []
    auto, plain = s["auto"], s["none"].max_batch
    losses = []
    for name, r in s.items():
        for n, p in r.points.items():
            mine = auto.at(n)
            if name != "auto" and p.fits and (mine is None or not mine.fits
                                              or mine.samples_per_s < p.samples_per_s * (1 - 1e-9)):  # fmt: skip
                losses.append(f"{name} at batch {n}")
    compared = sorted(auto.points)
    out.append({"target": "the joint strategy is at least as fast as every baseline wherever that baseline fits",
                "met": not losses, "detail": ("it is, at batches " + ", ".join(map(str, compared))
                                              + " (by construction: its search starts from every baseline's plan "
                                              "on the same simulator, so this checks the search, not the policy's "
                                              "merit)") if not losses
                else "slower than " + ", ".join(losses)})  # fmt: skip
    five = 5 * plain
    if w.keep_at_5x is not None:
        k = kept(s, five)
        if auto.max_batch < five:
            detail = _out_of_reach(s, "5x", five, wall)
        else:
            detail = f"keeps {k:.0%} at 5x ({five}); " + _costs(s, five)
            if k < w.keep_at_5x:
                detail = f"{(w.keep_at_5x - k) * 100:.0f} points short: " + detail + _regions_wall(s)
        out.append({"target": f"keeps >= {w.keep_at_5x:.0%} of the no-swap samples/s at 5x",
                    "met": k >= w.keep_at_5x, "detail": detail})  # fmt: skip
    if w.largest == "10x or the wall":
        ok = auto.max_batch >= 10 * plain
        detail = f"largest batch {auto.max_batch} ({auto.max_batch / plain:.2f}x)"
        if not ok:
            detail += f", {10 * plain - auto.max_batch} short of 10x. {_wall(auto, wall)}"
        out.append({"target": "largest batch >= 10x, or the result names what blocks it", "met": ok, "detail": detail})
    elif w.largest == "window's at 50 %":
        win = s["window"].max_batch
        k = kept(s, win)
        out.append({"target": "largest batch >= window's, keeping >= 50 % there",
                    "met": auto.max_batch >= win and k >= 0.5,
                    "detail": f"largest {auto.max_batch} vs window's {win} ({win / plain:.2f}x); at {win} it keeps "
                    f"{k:.0%} (window alone: {kept(s, win, 'window'):.0%}); " + _costs(s, win)
                    + (_regions_wall(s) if k < 0.5 else "")})  # fmt: skip
    elif w.largest == "10x at 60 %":
        ten = 10 * plain
        k = kept(s, ten)
        best = max((n for n in auto.points if kept(s, n) >= 0.6), default=0)
        if auto.max_batch < ten:
            detail = _out_of_reach(s, "10x", ten, wall)
        else:
            detail = f"at 10x ({ten}) it keeps {k:.0%}" + (f", {(0.6 - k) * 100:.0f} points short" if k < 0.6 else "")
            detail += f"; {_costs(s, ten)}"
        detail += f" The largest batch compared keeping >= 60 %: {best} ({best / plain:.1f}x)."
        out.append({"target": ">= 10x the no-swap batch at >= 60 % of its speed "
                              "(the window-scheduling paper: 7.5x at 55 %)",
                    "met": k >= 0.6, "detail": detail})
    return out


def _regions_wall(s: dict[str, StrategyResult]) -> str:
    """Why recompute cannot take more off the link: where checkpointing whole blocks stops fitting."""
    c = s.get("checkpoint")
    if c is None or not c.blocker:
        return ""
    return (f". Recompute is by whole blocks (the runtime checkpoints children of containers), and checkpointing "
            f"every block stops fitting past batch {c.max_batch}: {c.blocker.split('. ')[0]}: a "
            "block's rerun holds its recomputed tensors until its backward, so past that batch what is saved must "
            "cross the link instead")  # fmt: skip


def _out_of_reach(s: dict[str, StrategyResult], multiple: str, n: int, wall: list[dict[str, Any]]) -> str:
    """Why a target's batch ``n`` (``multiple`` of the no-swap batch) is missed: no strategy fits it."""
    auto = s["auto"]
    return (f"{multiple} ({n}) does not fit with any strategy: the largest batch is {auto.max_batch} "
            f"({auto.max_batch / s['none'].max_batch:.2f}x), keeping {kept(s, auto.max_batch):.0%} there. "
            f"{_wall(auto, wall)}")  # fmt: skip


def _wall(auto: StrategyResult, wall: list[dict[str, Any]]) -> str:
    what = "; ".join(f"{t['op']} in {t['module'] or '(the loss, outside modules)'} {t['bytes'] / 2**30:.1f} GiB"
                     for t in wall[:3])  # fmt: skip
    return f"What blocks it one sample further: {auto.blocker}" + (f" Its largest tensors: {what}." if what else "")


def largest_tensors(args: dict[str, Any], n: int, top: int = 3) -> list[dict[str, Any]]:
    """The largest tensors one training step at batch ``n`` allocates (activations and temporaries), with the
    operator and module that made each: what a step's working set is made of at the wall."""
    t = capture(args["model_fn"], args["batch_fn"], n, optimizer=args["optimizer"], dtype=args["dtype"], steps=1)
    b, e = t.iterations()[-1]
    made: list[dict[str, Any]] = []
    last: Optional[int] = None
    keep = (TAG["temporary"], TAG["activation"])
    for k in range(b, e + 1):
        if t.op[k] == OP:
            last = k
        elif t.op[k] == ALLOC and last is not None and int(t.tag[k]) in keep:
            made.append({"bytes": int(t.size[k]), "op": t.op_name(last), "module": t.module_name(last) or ""})
    made.sort(key=lambda x: -x["bytes"])
    seen, out = set(), []
    for m in made:
        if (m["op"], m["module"]) not in seen:
            seen.add((m["op"], m["module"]))
            out.append(m)
        if len(out) == top:
            break
    return out
