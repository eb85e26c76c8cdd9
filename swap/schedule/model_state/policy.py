"""``ModelStatePolicy``: where model state lives and how it moves, said once, in the one vocabulary (Note [One
vocabulary for model state] in ``plan``), and handed alike to ``SwapManager(model_state=...)``, ``swap.plan(...,
model_state=...)`` and the FSDP2 path (``swap.fsdp2.offload_by_budget(..., policy=...)``).

Note [The model-state policy]
One frozen object, in the spirit of FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy``, replaces the string and
the loose arguments each entry point had (``model_state="offload"``, ``bucket_bytes=``, ``host_memory=``,
``state_per_param=``). It is validated when made, so a typo fails where it is written, not at the first
``opt.step()``. The old spellings still work and warn (``policy_of``): a string becomes
``ModelStatePolicy(placement=...)`` ("offload" read as "streamed"), and the old keyword arguments fill the
policy's fields. What an entry point cannot do yet with a field it refuses with a clear error, never ignores.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from ...units import parse_size
from .plan import OLD_SPELLINGS, PLACEMENTS, placement_named

Size = Union[int, str, None]


@dataclass(frozen=True)
class ModelStatePolicy:
    """Where a model's parameters, gradients and optimizer state live, and how they move (Note [The model-state
    policy]).

    Attributes:
        placement: ``"auto"`` (the default: chosen per bucket under the budget), or every bucket alike:
            ``"resident"`` (on the device, stepped there), ``"host_master"`` (a device compute copy of the weights,
            the master, gradients and optimizer state on the host, stepped there) or ``"streamed"`` (no device
            copy between uses; fetched ahead of each use like a saved activation). ``"offload"`` is the old
            spelling of ``"streamed"`` (a FutureWarning).
        bucket_bytes: parameters are packed, moved and stepped in buckets of about this many bytes (int or a size
            string such as ``"16MiB"``); None: from the weights and the budget (Note [Bucket size by default]).
        host_memory: host bytes offloaded model state may take (int or a size string); None: what the kernel
            reports available (the runtime), the host profile's memory (the forecast).
        compute_dtype: the dtype the device computes in while the host keeps fp32 masters and optimizer state
            (``torch.bfloat16`` or ``torch.float16``); None: the model's own dtype.
        host_threads: intra-op threads of the host step; None: the cores the threads launching device work
            leave (Note [Host threads]).
    """

    placement: str = "auto"
    bucket_bytes: Size = None
    host_memory: Size = None
    compute_dtype: Any = None
    host_threads: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", placement_named(self.placement, "placement", 4))
        object.__setattr__(self, "bucket_bytes", parse_size(self.bucket_bytes, "bucket_bytes", minimum=1,
                                                            none="from the weights and the budget"))  # fmt: skip
        object.__setattr__(self, "host_memory", parse_size(self.host_memory, "host_memory", minimum=1,
                                                           none="what the host has available"))  # fmt: skip
        if self.compute_dtype is not None:
            _check_dtype(self.compute_dtype)
        t = self.host_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"host_threads must be a positive int or None (from the cores free), not {t!r}")

    @property
    def offloads(self) -> bool:
        """Whether any bucket may live on the host (every placement but ``"resident"``)."""
        return self.placement != "resident"


def _check_dtype(dtype: Any) -> None:
    import torch  # the pure room touches torch only to name a dtype

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"compute_dtype must be a torch.dtype (torch.bfloat16 or torch.float16), not "
                        f"{type(dtype).__name__} {dtype!r}")  # fmt: skip
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype must be torch.bfloat16 or torch.float16 (the device computes in it, the "
                         f"host keeps fp32 masters), or None (the model's dtype), not {dtype!r}")  # fmt: skip


def policy_of(model_state: Any, where: str = "model_state", stacklevel: int = 3, **old: Any) -> ModelStatePolicy:
    """The policy an entry point was given (Note [The model-state policy]): a ``ModelStatePolicy`` as it is; a
    placement string (``PLACEMENTS``, or an old spelling) or None as ``ModelStatePolicy(placement=...)``, with a
    FutureWarning naming the new spelling for a string; ``old``: the old keyword arguments (``bucket_bytes=``,
    ``host_memory=``), those not None filling the policy's fields, each with a FutureWarning. A field given both
    ways is refused."""
    if model_state is None:
        policy = ModelStatePolicy()
    elif isinstance(model_state, ModelStatePolicy):
        policy = model_state
    elif isinstance(model_state, str):
        known = model_state in PLACEMENTS or model_state in OLD_SPELLINGS
        new = OLD_SPELLINGS.get(model_state, model_state)
        if known:
            warnings.warn(f"{where}={model_state!r} is an old spelling: pass {where}=swap.ModelStatePolicy("
                          f"placement={new!r}) (Note [The model-state policy])", FutureWarning,
                          stacklevel=stacklevel)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # warned once, above
            policy = ModelStatePolicy(placement=model_state)
    else:
        raise TypeError(f"{where} must be a swap.ModelStatePolicy (or None: the default policy), not "
                        f"{type(model_state).__name__}")  # fmt: skip
    given = {k: v for k, v in old.items() if v is not None}
    for k, v in given.items():
        if getattr(policy, k) != getattr(ModelStatePolicy(), k) and isinstance(model_state, ModelStatePolicy):
            raise ValueError(f"{k}= was given both as an argument and in the policy: give it once, as "
                             f"ModelStatePolicy({k}=...)")  # fmt: skip
        warnings.warn(f"{k}= is an old argument: pass {where}=swap.ModelStatePolicy({k}={v!r}) (Note [The "
                      "model-state policy])", FutureWarning, stacklevel=stacklevel)  # fmt: skip
    return replace(policy, **given) if given else policy
