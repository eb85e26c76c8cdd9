"""The manager's arguments, checked at construction: each bad value fails with a message that names the forms
it accepts."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch

from ..schedule.scheduler import POLICIES
from ..units import parse_size


def parse_window(window: Union[int, str]) -> Optional[int]:
    """``window=``: bytes, or None for "auto" (chosen by simulating the profiled iteration)."""
    if isinstance(window, str) and window.strip().lower() == "auto":
        return None
    try:
        return parse_size(window, "window", minimum=1)
    except (TypeError, ValueError) as e:
        message = str(e)
        if "window must be a number" in message:
            message = message.replace("window must be ", "window must be 'auto' or ", 1)
        else:
            message += "; or pass window='auto'"
        raise type(e)(message) from None


def check_strategy(strategy: Optional[str], policy: Optional[str]) -> str:
    """What the manager runs: "auto" (``strategy="auto"``, the default) or a policy (``policy=`` alone: swap
    only). ``policy="auto"`` is the old spelling of ``strategy="auto"`` and warns (Note [Policy and strategy]
    in swap/__init__.py)."""
    if policy == "auto":
        warnings.warn("SwapManager(policy='auto') is spelled SwapManager(strategy='auto') now: 'auto' is a strategy "
                      "(keep, swap or recompute), a policy is how saved tensors are swapped", DeprecationWarning,
                      stacklevel=3)  # fmt: skip
        policy, strategy = None, strategy or "auto"
    if strategy is not None and strategy != "auto":
        raise ValueError(f"unknown strategy {strategy!r}: SwapManager runs strategy='auto' (keep, swap or recompute "
                         f"each saved tensor), or swaps only with policy= one of {', '.join(map(repr, POLICIES))}")
    if strategy == "auto" and policy is not None:
        raise ValueError(f"strategy='auto' chooses how to swap itself: pass strategy='auto' or policy={policy!r}, "
                         "not both")  # fmt: skip
    if policy is None:
        return "auto"
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(map(repr, POLICIES))}, or "
                         "strategy='auto' to keep, swap or recompute")  # fmt: skip
    return policy


def check_steps(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int number of steps (>= 1), not {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be at least 1 step (got {value})")
    return value


def check_device(device: Any) -> torch.device:
    """``device=``: None for the current CUDA device if CUDA is available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    forms = "'cpu', 'cuda', 'cuda:N', an int or a torch.device"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be {forms}, not {type(device).__name__}")
    try:  # an int is a CUDA device's index (torch.device(0) asks for an accelerator, and fails without one)
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {forms}, not {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu', not {dev}")
    if dev.type == "cuda":
        check_cuda(dev, device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_cuda(dev: torch.device, asked: Any) -> None:
    """A CUDA ``device=`` this process can use, or a ValueError that says why not: torch's own check fails later,
    inside torch, with a bare AssertionError ("Torch not compiled with CUDA enabled")."""
    if torch.version.cuda is None and torch.version.hip is None:
        why = f"this PyTorch ({torch.__version__}) is built without CUDA: install a CUDA build of PyTorch"
    elif not torch.cuda.is_available():
        why = "no CUDA device is visible (see nvidia-smi, and CUDA_VISIBLE_DEVICES)"
    elif dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        why = f"this process sees {n} CUDA device{'s' if n != 1 else ''} (cuda:0 to cuda:{n - 1})"
    else:
        return
    raise ValueError(f"device={asked!r} cannot be used: {why}, or pass device='cpu'")


def check_arena(arena: Any) -> Any:
    if arena is not None and not (hasattr(arena, "set_oom_handler") and hasattr(arena, "capacity")):
        raise TypeError(
            f"arena must be a vmalloc.Arena (or None: found automatically when vmalloc is the CUDA "
            f"allocator), not {arena!r} ({type(arena).__name__})"
        )
    return arena


def check_flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r} ({type(value).__name__})")
    return value
