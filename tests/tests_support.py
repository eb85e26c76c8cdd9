"""Helpers shared by test modules."""

import os

SANITIZED_RUN = os.environ.get("VMALLOC_EXPECT_SANITIZED") == "1"
