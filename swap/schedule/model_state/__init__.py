"""Model state, planned once for the forecast and the runtime: pure (no CUDA, no I/O), layer 1.

The one room that says where a model's parameters, gradients and optimizer state live and what that costs. The
forecast (swap/forecast/: buckets from a captured trace, priced on device and host profiles) and the runtime
(swap/runtime/model_state/ and the FSDP2 path: buckets of the user's storages, priced by what it measured) call
the same functions, so a forecast's buckets, bytes and placements are the runtime's:

- ``plan``: ``Placement``, ``UpdateSite``, ``Bucket``, ``ModelStatePlan``, the one vocabulary (``PLACEMENTS``,
  ``placement_named``: Note [One vocabulary for model state]);
- ``packing``: the one packer (``pack``, ``pack_buckets``, ``ParamInfo``) and the bucket size by default
  (``default_bucket_bytes``);
- ``ledger``: optimizer state by optimizer (``STATE_TENSORS``), device, host and pinned bytes of a plan, the host
  memory a run takes (``predict_host``), ``ModelStateDoesNotFit`` and its host case ``HostMemoryError``;
- ``placing``: ``plan_model_state`` (placements within a room, by bytes);
- ``weights`` (buckets as clean variables of the activation sequence, and taken out of a profiled one:
  ``without_weights``), ``sim`` (the iteration with its host-step lane), ``choice`` (``candidates``, the one loop
  over rooms and resident shares, and ``choose_model_state``: the fastest simulated plan, the runtime's and the
  forecast's chooser);
- ``units``: FSDP2 units (blocks, shards, which units a rank offloads by a budget);
- ``policy``: ``ModelStatePolicy``, the user's one object (exported as ``swap.ModelStatePolicy``).
"""

from __future__ import annotations

from .choice import ModelStateChoice, choose_model_state
from .ledger import (
    STATE_TENSORS,
    HostMemoryError,
    HostPrediction,
    ModelStateDoesNotFit,
    device_bytes_of,
    host_bytes_of,
    plan_bytes,
    predict_host,
    state_bytes,
)
from .packing import ParamInfo, default_bucket_bytes, pack, pack_buckets
from .placing import plan_model_state
from .plan import PLACEMENTS, Bucket, ModelStatePlan, Placement, UpdateSite, placement_named
from .policy import ModelStatePolicy, policy_of
from .sim import ModelStatePrices, ModelStateSim, simulate_model_state
from .weights import BucketUses, with_weights

__all__ = [
    "PLACEMENTS", "STATE_TENSORS", "Bucket", "BucketUses", "HostMemoryError", "HostPrediction", "ModelStateChoice",
    "ModelStateDoesNotFit", "ModelStatePlan", "ModelStatePolicy", "ModelStatePrices", "ModelStateSim", "ParamInfo",
    "Placement", "UpdateSite", "choose_model_state", "default_bucket_bytes", "device_bytes_of", "host_bytes_of",
    "pack", "pack_buckets", "placement_named", "plan_bytes", "plan_model_state", "policy_of", "predict_host",
    "simulate_model_state", "state_bytes", "with_weights",
]  # fmt: skip
