"""What runs inside training, in rooms, lowest first (ARCHITECTURE.md, "The rooms of swap/runtime/"):

- ``machine``: copy engines, the pinned host pool, device-memory meters, timers, host memory;
- ``activations``: saved activations moved by a plan (hooks, executor, profiling iterations, swaps, recompute);
- ``auto``: the runtime side of ``strategy="auto"`` (operator profiler, regions, ranks, the joint plan);
- ``model_state``: parameters, gradients and optimizer state under the budget (one device, and FSDP2's half);
- here: the manager (``SwapManager``), its arguments, its planning (``scheduling``), notices and report.

Schedules come from ``swap.schedule`` and recompute plans from ``swap.joint`` (both pure, called with what the
runtime measured); nothing here decides a schedule itself, and nothing here imports the forecast
(``swap.forecast``) or tiling (``swap.tiling``), the rooms beside it. Modules that moved into the rooms keep
their old names for one release (Note [Forwarders for moved modules])."""

from ._moved import install as _install_forwarders

_install_forwarders()
