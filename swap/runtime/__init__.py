"""What runs inside training: the manager (``SwapManager``), the executor that follows a plan from inside the
saved-tensor hooks, the tracer and recorder that profile, the copy engines, the host pool, the device-memory
meters, the runtime side of recompute, and the report. Plans come from ``swap.planning``; nothing here decides
a schedule itself."""
