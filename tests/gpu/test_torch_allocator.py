"""vmalloc installed as torch's allocator (globally and as a MemPool): training is bitwise unchanged."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_small.py")


def losses(mode: str) -> tuple[str, str]:
    r = subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    return lines[0], "\n".join(lines[1:])


def test_global_allocator_trains_bitwise_identically():
    ref, _ = losses("default")
    got, stats = losses("vmalloc")
    assert got == ref
    assert stats.startswith("STATS")


def test_mem_pool_trains_bitwise_identically():
    ref, _ = losses("default")
    got, _ = losses("vmalloc_pool")
    assert got == ref
