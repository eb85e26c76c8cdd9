"""What runs inside training: the manager (``SwapManager``), the executor that follows a plan from inside the
saved-tensor hooks, the tracer and recorder that profile, the copy engines, the host pool, the device-memory
meters, the runtime side of recompute, and the report. Schedules come from ``swap.schedule`` and recompute plans
from ``swap.joint`` (both pure, called with what the runtime measured); nothing here decides a schedule itself,
and nothing here imports the forecast (``swap.forecast``) or tiling (``swap.tiling``), the rooms beside it."""
