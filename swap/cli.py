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
import difflib
import importlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .capture import CaptureError
from .devices import ALIASES, HOST_PROFILES, INTERCONNECTS, PROFILES, TF32_SETTINGS, refuse_budget_above
from .devices import profile as device_profile
from .forecast.arguments import check_model_fn
from .forecast.distributed import SHARDINGS
from .forecast.planner import plan
from .forecast.replay import ALLOCATORS
from .forecast.strategies import STRATEGIES
from .forecast.strategy_report import pyplot
from .forecast.zoo import ZOO
from .schedule.model_state import PLACEMENTS, ModelStatePolicy
from .schedule.model_state.plan import OLD_SPELLINGS
from .schedule.scheduler import POLICIES
from .units import fmt_bytes, parse_size

OPTIMIZERS = ("adamw", "adam", "sgd")
OPTIMIZER_DEFAULT = "sgd (with momentum) for the built-in models, adamw for your own"
DTYPES = ("float32", "bfloat16", "float16")
EVERY = "every"  # --strategies every: each strategy (Note [Policy and strategy]); "all" names one of them
SIZE_FLAGS = ("--budget", "--min-bytes")
NOTHING_FITS = 1  # the exit status when no batch fits the budget, model state offloaded or not (2: the command
# line is wrong)


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


def _sizes_may_be_negative(argv: list[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse takes a value that starts with a dash for an option
    ("expected one argument"), and the size parser is to refuse it, saying why."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIZE_FLAGS and re.match(r"-[\d.]", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _positive(text: str) -> int:
    """A count of at least 1 (argparse names the flag: "argument --max-batch: must be at least 1, not -1")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _writable(path: str, flag: str) -> Optional[str]:
    """Why ``path`` cannot be written (None: it can), asked before planning, not after it."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return f"{flag} {path}: is a folder; give a file name"
    if not folder.is_dir():
        return f"{flag} {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"{flag} {path}: cannot write there (permission denied)"
    return None


def _unknown_model(spec: str) -> Optional[str]:
    """Why ``--model spec`` names nothing (None: a built-in, or a file or module of the user's, which
    ``load_callable`` reads): a bare name that is neither a built-in nor a module is a built-in misspelt, not a
    model of the user's (for which --batch would be asked)."""
    if spec in ZOO or any(c in spec for c in ":./\\") or Path(spec).exists():
        return None
    try:
        if importlib.util.find_spec(spec) is not None:
            return None
    except (ImportError, ValueError):
        pass
    near = difflib.get_close_matches(spec, ZOO, n=1, cutoff=0.6)
    return (f"--model {spec}: no such built-in model" + (f" (did you mean {near[0]}?)" if near else "")
            + f"; the built-ins are {', '.join(ZOO)}; your own model is FILE.py:FUNCTION or package.module:FUNCTION")


def _strategies(value: str, ap: argparse.ArgumentParser) -> tuple[str, ...]:
    """``--strategies``: every, off, or names. ``all`` alone, the old spelling of every, still means every
    strategy, with a warning: it is also the name of one strategy (swap all), which ``all,`` asks for alone."""
    if value == "all":
        print("swap.plan: --strategies all means every strategy, as before; spell it --strategies every: 'all' is "
              "also the name of one strategy (swap every saved tensor), which --strategies all, asks for alone",
              file=sys.stderr)  # fmt: skip
        value = EVERY
    if value in (EVERY, "off"):
        return STRATEGIES if value == EVERY else ()
    names = tuple(s for s in value.split(",") if s)
    for s in names:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r} in --strategies: choose {EVERY}, off, or among {', '.join(STRATEGIES)}")
    return names


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
    ap.add_argument("--device", default="h100-pcie", choices=sorted(list(PROFILES) + list(ALIASES)),
                    help="the device profile to simulate on (default: h100-pcie)")
    ap.add_argument("--profile", default=None, help="a measured profile (SwapManager.save_profile) to calibrate with")
    ap.add_argument("--allocator", default="vmalloc", choices=[*ALLOCATORS, "ideal"],
                    help="replay each policy's run on this allocator; ideal: no fragmentation (default: vmalloc)")
    ap.add_argument("--policies", default="none,window,fixed_distance,all",
                    help=f"swap policies to plan, comma-separated, among {','.join(POLICIES)} (default: each)")
    ap.add_argument("--max-batch", type=_positive, default=None,
                    help="the largest batch to consider (default: no limit but the budget)")
    ap.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help=f"default: {OPTIMIZER_DEFAULT}")
    ap.add_argument("--dtype", default=None, choices=DTYPES, help="train the model in this dtype")
    ap.add_argument("--size", type=_positive, default=None, help="built-ins: image side or sequence length")
    ap.add_argument("--min-bytes", default="1MiB", help="saved tensors below this stay on the device")
    ap.add_argument("--strategies", default=EVERY,
                    help=f"keep/swap/recompute strategies to compare: {EVERY} (the default), off, or some of "
                         f"{','.join(STRATEGIES)}")  # fmt: skip
    ap.add_argument("--at-batch", type=_positive, default=None,
                    help="also compare the strategies at this batch size")
    ap.add_argument("--plot", default=None, help="write a PNG of samples/s against batch, one line per strategy "
                    "(without strategies: one step's memory, unswapped and swapped)")
    ap.add_argument("--plot-memory", default=None, help="write a PNG of one step's memory, unswapped and swapped")
    ap.add_argument("--host", default=None, help="also plan model state (parameters, gradients, optimizer state) "
                    f"under the budget at --at-batch, on this host profile ({', '.join(HOST_PROFILES)}, or a JSON "
                    "file bench/host_profile.py wrote), beside other systems' offload schedules (simulated). "
                    "Without it, where no batch fits, model-state offload is planned on a default host profile "
                    "(named in the output)")
    ap.add_argument("--model-state", default=None, choices=PLACEMENTS + tuple(OLD_SPELLINGS),
                    help="with --host: where model state lives (swap.ModelStatePolicy's placement; default auto; "
                    "'offload' is the old spelling of 'streamed')")
    ap.add_argument("--compute-dtype", default=None, choices=DTYPES[1:],
                    help="with --host: mixed precision, as SwapManager(compute_dtype=) trains an fp32 model "
                    "(swap.ModelStatePolicy's compute_dtype): the device computes in this dtype, the host keeps fp32 "
                    "masters, gradients and optimizer state")
    ap.add_argument("--tf32", default="auto", choices=TF32_SETTINGS,
                    help="fp32 convolutions and matmuls on TF32 tensor cores: auto (PyTorch's flags: convolutions "
                         "yes, matmuls after torch.backends.cuda.matmul.allow_tf32 = True), on (both), off (neither)")
    ap.add_argument("--json", default=None, help="write the plan as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--world-size", type=int, default=1, help="forecast one rank of this many (with --shard)")
    ap.add_argument("--shard", default=None, choices=SHARDINGS, help="how the ranks split the model: fsdp2 shards "
                    "each block and the root (the budget and batches are per rank); fsdp2-offload also keeps the "
                    "offloaded units' model state on the host, stepped there (swap.fsdp2.HostSteps)")
    ap.add_argument("--interconnect", default=None, choices=sorted(INTERCONNECTS),
                    help="what the collectives run on (default nvlink4)")
    ap.add_argument("--largest-image", action="store_true",
                    help="instead of the largest batch: the largest square image (batch 1, or --max-batch) the model "
                         "trains on under the budget, untiled, checkpointed, tiled (swap.tiled) and tiled + swapped")
    args = ap.parse_args(_sizes_may_be_negative(sys.argv[1:] if argv is None else argv))
    import torch

    try:  # before any capture: Note [A budget above the device's memory] (swap/schedule/budget.py)
        refuse_budget_above(parse_size(args.budget, "--budget", minimum=1), device_profile(args.device), args.device,
                            spell=lambda option, value: f"--{option} {value}")  # fmt: skip
        parse_size(args.min_bytes, "--min-bytes")
    except ValueError as e:
        ap.error(str(e))
    policies = tuple(p for p in args.policies.split(",") if p)
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r} in --policies: choose among {', '.join(POLICIES)}")
    strategies = _strategies(args.strategies, ap)
    if args.model_state and not args.host:
        ap.error(f"--model-state needs --host (one of {', '.join(HOST_PROFILES)}, or a file bench/host_profile.py "
                 "wrote)")
    if args.compute_dtype and not args.host:
        ap.error(f"--compute-dtype needs --host (one of {', '.join(HOST_PROFILES)}, or a file bench/host_profile.py "
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
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--plot-memory", args.plot_memory)):
        why = path and _writable(path, flag)
        if why:
            ap.error(why)  # before the planning, not after it
    why = _unknown_model(args.model)
    if why:
        ap.error(why)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    optimizer = _optimizer(args.optimizer) if args.optimizer else None
    try:
        if args.model in ZOO:
            w = ZOO[args.model]
            model_fn, batch_fn, name = w.model_fn(), w.batch_fn(args.size), args.model
            optimizer = optimizer or w.optimizer
            if not args.compute_dtype:  # under --compute-dtype the model is fp32, cast for compute
                dtype = dtype or w.dtype
            if args.batch:
                batch_fn = load_callable(args.batch, "batch_fn")
        else:
            model_fn = load_callable(args.model, "model_fn")
            check_model_fn(model_fn, f"--model {args.model}")
            if not args.batch:
                ap.error("--batch FILE.py:FUNCTION is needed with your own model (FUNCTION(n) returns a batch of n)")
            batch_fn = load_callable(args.batch, "batch_fn")
            name = args.model
        loss_fn = load_callable(args.loss, "loss_fn") if args.loss else None
    except (SpecError, TypeError) as e:
        ap.error(str(e))
    if args.largest_image:
        return _largest_image(model_fn, args, dtype)
    try:
        result = plan(
            model_fn, batch_fn, loss_fn, budget=args.budget, device=args.device,
            allocator=None if args.allocator == "ideal" else args.allocator, max_batch=args.max_batch,
            optimizer=optimizer, dtype=dtype, profile=args.profile, policies=policies, min_bytes=args.min_bytes,
            name=name, progress=not args.quiet, strategies=strategies, batch=args.at_batch,
            world_size=args.world_size, shard=args.shard, interconnect=args.interconnect,
            model_state=ModelStatePolicy(placement=args.model_state or "auto",
                                         compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype
                                         else None) if args.host else None,
            host=args.host, tf32=args.tf32,
        )  # fmt: skip
    except (CaptureError, ValueError) as e:
        print(f"swap.plan: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if not _write(result, args):
        return 2
    if result.fits_nothing and not result.offload_fits:  # a plan with model state offloaded is a plan: exit 0
        print(f"swap.plan: {_nothing_fits(result, args)}", file=sys.stderr)
        return NOTHING_FITS
    return 0


def _write(result: Any, args: argparse.Namespace) -> bool:
    """The figures and the JSON asked for; False when one could not be written (said on stderr)."""
    plots = [(args.plot, "--plot", result.plot_strategies if result.strategies else result.plot),
             (args.plot_memory, "--plot-memory", result.plot)]  # fmt: skip
    try:
        for path, flag, draw in plots:
            if path:
                try:
                    print(f"wrote {draw(path)}")
                except ValueError as e:  # nothing to plot: no batch fits
                    print(f"swap.plan: {flag}: {e}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
            print(f"wrote {args.json}")
    except OSError as e:  # checked before planning; the disk may still fill up, or the folder go
        print(f"swap.plan: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return False
    return True


def _nothing_fits(result: Any, args: argparse.Namespace) -> str:
    """The plan's ``nothing_fits`` in the command line's words: the --budget to pass."""
    if result.min_budget is None:
        return (f"no batch fits --budget {args.budget}, and batch 1 does not fit even in all of {args.device}'s "
                f"memory ({fmt_bytes(result.device.memory)}): choose a device with more (--device), or a lower "
                "--min-bytes so that more can be swapped")  # fmt: skip
    mib = -(-result.min_budget // (1 << 20))
    return (f"no batch fits --budget {args.budget}: pass --budget {mib}MiB or more (batch 1 fits from "
            f"{result.min_budget} bytes, under policy {result.min_budget_policy!r})")


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
