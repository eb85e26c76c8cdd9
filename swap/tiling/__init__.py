"""Tiled execution, for activations too large for the device even one at a time: a chain of convolutions, or
a causal LM's head and loss, runs tile by tile, with only the chain's boundaries kept whole, and the tile counts
chosen so the step fits the budget (Note [FT-compatible operators] in ``plan/rules.py``).

``plan/`` decides (which operators tile, the segments, the tile counts from the budget, the predicted peak
and step time, the largest image per strategy); ``run/`` executes (the tiled autograd function, spatial
segments, the tiled model and LM head, ``swap.tiled``). It prices tiles on the device profiles (``swap.devices``)
and imports neither the runtime nor the forecast, the rooms beside it.
"""
