"""``python -m swap.plan``: the command line of ``swap.plan`` (``swap.cli``).

Note [swap.plan is a function]
``swap.plan(model_fn, batch_fn, ...)`` is the planning function, and ``python -m swap.plan`` must run its
command line. A submodule named ``swap.plan`` would replace the package attribute with itself the moment
anything imported it (``import swap.plan`` sets ``swap.plan = <module>``), so this file is only ever run as a
script: ``python -m`` executes it as ``__main__`` without importing it as ``swap.plan``, and importing it
fails loudly instead of silently taking the function's place. The command line lives in
``swap.cli`` (``main(argv)``), the function in ``swap.forecast``.
"""

import sys

if __name__ != "__main__":
    raise ImportError(
        "swap.plan is the planning function (swap.plan(model_fn, batch_fn, budget=...)), not a module to import; "
        "the command line is `python -m swap.plan`, or swap.cli.main(argv) from Python"
    )

from swap.cli import main  # noqa: E402 - after the guard

sys.exit(main())
