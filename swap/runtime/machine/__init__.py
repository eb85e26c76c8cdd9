"""The machine under training: the copy engines and their events, the pinned host pool, the device-memory meters
and budget, the step timers, and how much host memory there is. Knows nothing of plans or models."""
