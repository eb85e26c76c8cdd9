"""``python -m swap``: the command line of ``swap.plan`` (``swap.cli``); ``python -m swap.plan`` runs the same."""

import sys

from swap.cli import main

sys.exit(main())
