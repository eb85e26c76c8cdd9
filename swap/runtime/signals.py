"""The signals the runtime gives while training goes on."""

from __future__ import annotations


class BudgetWarning(UserWarning):
    """The swap runtime could not keep the budget, or had nothing to do: nothing could be swapped, the
    budget was exceeded because of ``min_bytes``, ``exclude`` or a device mismatch, or an iteration measured
    more than it was planned for. Each cause is warned about once per manager."""
