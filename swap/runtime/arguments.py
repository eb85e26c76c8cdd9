"""The manager's arguments, checked at construction: each bad value fails with a message that names the forms
it accepts."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..planning.scheduler import POLICIES

Size = Union[int, str, None]

SIZE_FORMS = "a number of bytes or a size string such as '12GiB', '512MiB', '1.5GiB'"
MANAGER_POLICIES = ("auto",) + POLICIES  # "auto": swap.runtime.joint (Note [Applying a joint plan])


def parse_size(value: Size, what: str, *, minimum: int = 0, none: str = "") -> Optional[int]:
    """An int or a size string as bytes (None stays None). ``none`` says what None means, for messages."""
    forms = SIZE_FORMS + (f", or None ({none})" if none else "")
    if value is None:
        if none:
            return None
        raise TypeError(f"{what} must be {forms}, not None")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be {forms}, not {value!r} ({type(value).__name__})")
    if isinstance(value, int):
        n = value
    else:
        from vmalloc import parse_size as vparse

        try:
            n = vparse(value)
        except ValueError:
            raise ValueError(f"{what} must be {forms}, not {value!r} (invalid size)") from None
    if n < 0:
        raise ValueError(f"{what} must not be negative (got {value!r})")
    if n < minimum:
        raise ValueError(f"{what} must be at least {minimum} byte{'s' if minimum != 1 else ''} (got {value!r})"
                         + (f"; None means {none}" if none else ""))  # fmt: skip
    return n


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


def check_policy(policy: Any) -> str:
    if not isinstance(policy, str) or policy not in MANAGER_POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(repr(p) for p in MANAGER_POLICIES)}")
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
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {forms}, not {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu', not {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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
