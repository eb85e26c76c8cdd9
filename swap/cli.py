"""python -m swap.plan: the largest batch of a model that fits a budget, per swap policy, and its speed.

    python -m swap.plan --model my_model.py:model_fn --batch my_model.py:batch_fn --budget 24GiB --device h100-pcie
    python -m swap.plan --model resnet50 --budget 16GiB --device v100-16gb
    python -m swap.plan --model vgg16 --budget 11GiB --device rtx2080ti-11gb --largest-image
    python -m swap.plan --model llama3-8b-bf16 --budget 24GiB --device rtx4090-24gb --host desktop-ddr5-2ch \
        --at-batch 8 --strategies off --policies none

``--model`` is a built-in model (resnet50, densenet121, unet, gpt2, gpt2-bf16, gpt2-medium-bf16) or
``FILE.py:FUNCTION`` / ``package.module:FUNCTION`` returning an nn.Module; ``--batch`` (``FUNCTION(n)``
returns a batch of n) and ``--loss`` (``FUNCTION(model, batch)`` returns the loss) likewise; without
``:FUNCTION`` the names model_fn, batch_fn and loss_fn are looked up. The training step is captured on the
meta device (no memory is used, whatever the batch), planned against the budget and simulated on the device
profile.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .capture import CaptureError
from .devices import ALIASES, HOST_PROFILES, PROFILES, refuse_budget_above
from .devices import profile as device_profile
from .forecast.planner import plan
from .forecast.replay import ALLOCATORS
from .forecast.strategies import STRATEGIES
from .forecast.strategy_report import pyplot
from .forecast.zoo import ZOO
from .schedule.model_state import MODES
from .schedule.scheduler import POLICIES
from .units import parse_size

OPTIMIZERS = ("adamw", "adam", "sgd")
DTYPES = ("float32", "bfloat16", "float16")


class SpecError(ValueError):
    pass


def _module_from_file(path: Path) -> Any:
    name = f"_swap_plan_user_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # the user's file may import its neighbours
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def load_callable(spec: str, default: str) -> Callable[..., Any]:
    """``FILE.py:NAME``, ``package.module:NAME``, or either without ``:NAME`` (then ``default``)."""
    where, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", default)
    attr = attr or default
    path = Path(where)
    if where.endswith(".py") or path.is_file():
        if not path.is_file():
            raise SpecError(f"{where}: no such file")
        module = _module_from_file(path)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise SpecError(f"{where!r} is neither a .py file nor an importable module ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SpecError(f"{where} has no function {attr!r}; it defines: {', '.join(names) or 'nothing callable'}")
    return fn


def _optimizer(name: str) -> Callable[[Any], Any]:
    import torch

    return {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    }[name]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swap.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", required=True, help=f"built-in ({', '.join(ZOO)}) or FILE.py:FUNCTION")
    ap.add_argument("--batch", default=None, help="FILE.py:FUNCTION, FUNCTION(n) -> batch of n (built-ins have one)")
    ap.add_argument("--loss", default=None, help="FILE.py:FUNCTION, FUNCTION(model, batch) -> loss (optional)")
    ap.add_argument("--budget", required=True, help="device memory for the run, e.g. 24GiB")
    ap.add_argument("--device", default="h100-pcie", choices=sorted(list(PROFILES) + list(ALIASES)))
    ap.add_argument("--profile", default=None, help="a measured profile (SwapManager.save_profile) to calibrate with")
    ap.add_argument("--allocator", default="vmalloc", choices=[*ALLOCATORS, "ideal"])
    ap.add_argument("--policies", default="none,window,fixed_distance,all")
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help="default: sgd for built-ins, else adamw")
    ap.add_argument("--dtype", default=None, choices=DTYPES, help="train the model in this dtype")
    ap.add_argument("--size", type=int, default=None, help="built-ins: image side or sequence length")
    ap.add_argument("--min-bytes", default="1MiB", help="saved tensors below this stay on the device")
    ap.add_argument("--strategies", default="all",
                    help=f"keep/swap/recompute strategies to compare: all, off, or some of {','.join(STRATEGIES)}")
    ap.add_argument("--at-batch", type=int, default=None, help="also compare the strategies at this batch size")
    ap.add_argument("--plot", default=None, help="write a PNG of samples/s against batch, one line per strategy "
                    "(without strategies: one step's memory, unswapped and swapped)")
    ap.add_argument("--plot-memory", default=None, help="write a PNG of one step's memory, unswapped and swapped")
    ap.add_argument("--host", default=None, help="also plan model state (parameters, gradients, optimizer state) "
                    f"under the budget at --at-batch, on this host profile ({', '.join(HOST_PROFILES)}, or a JSON "
                    "file bench/host_profile.py wrote), beside other systems' offload schedules (simulated)")
    ap.add_argument("--model-state", default=None, choices=MODES,
                    help="with --host: how to place model state (default auto)")
    ap.add_argument("--json", default=None, help="write the plan as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--largest-image", action="store_true",
                    help="instead of the largest batch: the largest square image (batch 1, or --max-batch) the model "
                         "trains on under the budget, untiled, checkpointed, tiled (swap.tiled) and tiled + swapped")
    args = ap.parse_args(argv)
    import torch

    try:  # before any capture: Note [A budget above the device's memory] (swap/schedule/budget.py)
        refuse_budget_above(parse_size(args.budget, "--budget", minimum=1), device_profile(args.device), args.device,
                            spell=lambda option, value: f"--{option} {value}")  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    policies = tuple(p for p in args.policies.split(",") if p)
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}: choose among {', '.join(POLICIES)}")
    strategies = {"all": STRATEGIES, "off": ()}.get(args.strategies)
    if strategies is None:
        strategies = tuple(s for s in args.strategies.split(",") if s)
        for s in strategies:
            if s not in STRATEGIES:
                ap.error(f"unknown strategy {s!r} in --strategies: choose all, off, or among {', '.join(STRATEGIES)}")
    if args.at_batch is not None and args.at_batch < 1:
        ap.error(f"--at-batch must be at least 1, not {args.at_batch}")
    if args.model_state and not args.host:
        ap.error(f"--model-state needs --host (one of {', '.join(HOST_PROFILES)}, or a file bench/host_profile.py "
                 "wrote)")
    if args.at_batch is not None and not strategies and not args.host:
        ap.error("--at-batch compares the strategies at a batch: drop --strategies off, or drop --at-batch")
    if (args.host or args.model_state) and args.at_batch is None:
        ap.error("--host forecasts model state at one batch: pass --at-batch N")
    if args.plot or args.plot_memory:
        try:  # before the planning, not after it
            pyplot()
        except ImportError as e:
            ap.error(f"{'--plot' if args.plot else '--plot-memory'}: {e}")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    optimizer = _optimizer(args.optimizer) if args.optimizer else None
    try:
        if args.model in ZOO:
            w = ZOO[args.model]
            model_fn, batch_fn, name = w.model_fn(), w.batch_fn(args.size), args.model
            optimizer = optimizer or w.optimizer
            dtype = dtype or w.dtype
            if args.batch:
                batch_fn = load_callable(args.batch, "batch_fn")
        else:
            if not args.batch:
                ap.error("--batch FILE.py:FUNCTION is needed with your own model (FUNCTION(n) returns a batch of n)")
            model_fn = load_callable(args.model, "model_fn")
            batch_fn = load_callable(args.batch, "batch_fn")
            name = args.model
        loss_fn = load_callable(args.loss, "loss_fn") if args.loss else None
    except SpecError as e:
        ap.error(str(e))
    if args.largest_image:
        return _largest_image(model_fn, args, dtype)
    try:
        result = plan(
            model_fn, batch_fn, loss_fn, budget=args.budget, device=args.device,
            allocator=None if args.allocator == "ideal" else args.allocator, max_batch=args.max_batch,
            optimizer=optimizer, dtype=dtype, profile=args.profile, policies=policies, min_bytes=args.min_bytes,
            name=name, progress=not args.quiet, strategies=strategies, batch=args.at_batch,
            model_state=args.model_state or ("auto" if args.host else None), host=args.host,
        )  # fmt: skip
    except (CaptureError, ValueError) as e:
        print(f"swap.plan: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if args.plot:
        print(f"wrote {result.plot_strategies(args.plot) if result.strategies else result.plot(args.plot)}")
    if args.plot_memory:
        print(f"wrote {result.plot(args.plot_memory)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _largest_image(model_fn: Callable[[], Any], args: argparse.Namespace, dtype: Any) -> int:
    """``--largest-image``: Note [Strategies for one large image] in swap/tiling/plan/largest.py."""
    import torch

    from .tiling.plan.choose import TilingInfeasible
    from .tiling.plan.largest import image_table, largest_images, stderr_progress

    with torch.device("meta"):  # VGG-16's 138 M parameters and any image size: no memory
        model = model_fn()
    budget = parse_size(args.budget, "--budget", minimum=1)
    try:
        say = None if args.quiet else stderr_progress
        found = largest_images(model, budget, device_profile(args.device), batch=args.max_batch or 1,
                               dtype=dtype or torch.float32, progress=say)  # fmt: skip
    except (TilingInfeasible, ValueError, TypeError) as e:
        print(f"swap.plan: {e}", file=sys.stderr)
        return 2
    print(image_table(found, budget, args.device))
    if args.json:
        Path(args.json).write_text(json.dumps({k: v and vars(v) for k, v in found.items()}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
