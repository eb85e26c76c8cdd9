"""Saved activations, moved by a plan: the saved-tensor hooks, the executor that follows the plan from inside them,
the profiling iterations that record it (tracer, recorder, lifecycle, the plans kept by input shape), the swaps
(transfers, eviction, residency) and the runtime side of recompute."""
