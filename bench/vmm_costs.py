"""What the CUDA driver's virtual-memory calls cost: host time per call, by GPU generation and chunk size.

vmalloc maps fixed-size chunks into virtual ranges (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``,
``cuMemUnmap``, ``cuMemRelease``). Each call is synchronous host work: while the allocator maps, the host
issues no kernel, so the compute stream waits (swap.schedule.simulator charges it there). ``VmmCosts.seconds``
turns an allocator's counts (its ``stats()``: num_created_chunks, num_maps, num_unmaps, num_device_free)
into that time.

Note [VMM cost figures]
Until ``make gpu`` measures them (``load``, from bench/results/gpu/<device>/vmm_latency.json), the figures
are published ones:

- Per 2 MiB chunk on an A100-80GB, one thread, mean of 4096 calls: cuMemCreate 193 us, cuMemMap 1.45 us,
  cuMemSetAccess 36.0 us, cuMemUnmap 25.6 us (kvcached, benchmarks/bench_vmm/README.md, "Sample Output on
  A100", github.com/ovg-project/kvcached). cuMemRelease was not measured there; it is taken equal to
  cuMemUnmap (both return the pages to the driver) -- an assumption.
- The cost of map/unmap grows with the number of physical handles, not with bytes: "mapping 10 separately
  allocated 2MiB pages takes 10x time compared to mapping one 20MiB physical allocation of 10 pages", and
  remapping involves synchronous work with the GPU (PyTorch's expandable-segments note, pytorch#96995). So
  map, set_access, unmap and release cost the same per chunk whatever its size, while cuMemCreate, which
  must clear the pages it hands out, is taken to scale with bytes (193 us per 2 MiB, about 10.9 GB/s).
- No per-call figures were found for V100. Its entry (and Ada's, Pascal's) uses the A100 figures (same driver
  code path); ``source`` says so, and a measured file replaces them.
- Hopper is measured (bench/results/gpu/NVIDIA_H200/vmm_latency.json, an H200 with driver 580.159, ``make
  gpu``): per call, median of 200, 2 / 4 / 20 / 64 MiB chunks: cuMemCreate 14.7 / 14.0 / 14.3 / 17.5 us,
  cuMemMap 2.7 / 2.7 / 2.8 / 1.6, cuMemSetAccess 30.3 / 30.5 / 31.2 / 37.9, cuMemUnmap 20.0 / 20.1 / 20.4 /
  23.2, cuMemRelease 14.6 / 17.4 / 30.5 / 41.3. Creating a chunk is *not* priced by its bytes there (13x
  cheaper than the A100 figure at 2 MiB, and flat from 2 to 64 MiB), so a measured table is used at its
  nearest measured chunk size as it stands, never scaled; the byte scaling stays an assumption of the
  published single-size figures only.

For scale: GMLake users report 20-40 ms per stitch (antgroup/glake#22), and this project's host backend
takes 10-110 us per 2 MiB chunk reclaimed (measured on this project's host backend).

Note [vmm_latency.json]
``load`` reads what ``make gpu`` writes, bench/results/gpu/<device>/vmm_latency.json (bench/gpu/vmm_latency.py:
each call timed alone, for each chunk size)::

    {"environment": {"device": "NVIDIA H100 80GB HBM3", ...},
     "results_us": {"2": {"cuMemCreate": {"median_us": 190.0, "p90_us": 330.0, "n": 200},
                          "cuMemMap": {...}, "cuMemSetAccess": {...}, "cuMemUnmap": {...}, "cuMemRelease": {...}},
                    "20": {...}}}

Keys of ``results_us`` are chunk sizes in MiB; every call maps or sets access on one whole chunk. ``load`` takes
the medians for the measured chunk size nearest to the one asked for, unscaled (Note [VMM cost figures]), and
keeps the whole table, so ``for_chunk`` on a measured entry picks its nearest size again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

MiB = 1 << 20
US = 1e-6


@dataclass(frozen=True)
class VmmCosts:
    """Host seconds per driver call on one chunk of ``chunk_size`` bytes."""

    name: str
    source: str
    chunk_size: int
    create: float
    map: float
    set_access: float
    unmap: float
    release: float
    # Measured per chunk size (bytes -> create, map, set_access, unmap, release seconds); empty for the published
    # single-size figures.
    by_size: tuple[tuple[int, tuple[float, float, float, float, float]], ...] = ()

    def for_chunk(self, chunk_size: int) -> VmmCosts:
        """The same device with chunks of ``chunk_size`` bytes (Note [VMM cost figures]): a measured table's
        nearest size as measured; else only creating a chunk costs more for a larger one."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {chunk_size}")
        if self.by_size:
            _, costs = min(self.by_size, key=lambda e: abs(e[0] - chunk_size))
            return replace(self, chunk_size=chunk_size, **dict(zip(CALLS, costs)))
        return replace(self, chunk_size=chunk_size, create=self.create * chunk_size / self.chunk_size)

    def seconds(self, maps: int, unmaps: int, creates: int = 0, releases: int = 0) -> float:
        """Host time for this many map calls (each with its share of ``cuMemSetAccess``), unmap calls, chunks
        created and release calls."""
        return (
            creates * self.create + maps * (self.map + self.set_access) + unmaps * self.unmap + releases * self.release
        )

    def seconds_from_stats(self, stats: dict[str, int]) -> float:
        """``seconds`` from a vmalloc ``stats()`` dict (or a difference of two)."""
        return self.seconds(
            stats.get("num_maps", 0), stats.get("num_unmaps", 0), stats.get("num_created_chunks", 0),
            stats.get("num_device_free", 0),
        )  # fmt: skip


_A100 = dict(create=193.32 * US, map=1.45 * US, set_access=35.99 * US, unmap=25.63 * US, release=25.63 * US)
_SOURCE = "kvcached bench_vmm (A100-80GB, 2 MiB, mean of 4096 calls); release taken = unmap"
COSTS = {
    "ampere": VmmCosts("A100 (published)", _SOURCE, 2 * MiB, **_A100),
    "volta": VmmCosts("V100 (A100 figures: none published)", _SOURCE + "; A100 figures used", 2 * MiB, **_A100),
    "hopper": VmmCosts("H100 (A100 figures: none published)", _SOURCE + "; A100 figures used", 2 * MiB, **_A100),
    "ada": VmmCosts("L4/RTX 4090 (A100 figures: none published)", _SOURCE + "; A100 figures used", 2 * MiB, **_A100),
    "pascal": VmmCosts("P100 (A100 figures: none published)", _SOURCE + "; A100 figures used", 2 * MiB, **_A100),
}
FREE = VmmCosts("free (VMM work not counted)", "none", 2 * MiB, 0.0, 0.0, 0.0, 0.0, 0.0)
_GENERATION = {"v100": "volta", "p100": "pascal", "a100": "ampere", "h100": "hopper", "h200": "hopper",
               "l4": "ada", "rtx4090": "ada"}  # fmt: skip


def for_device(name: str, chunk_size: int = 2 * MiB) -> VmmCosts:
    """The costs for a device profile name (``v100``, ``v100-16gb``, ``h100-sxm``, ...) or a generation."""
    key = name.lower()
    gen = key if key in COSTS else next((g for p, g in _GENERATION.items() if key.startswith(p)), None)
    if gen is None:
        raise ValueError(
            f"no VMM costs for device {name!r}: use one of {', '.join(sorted(_GENERATION))} or a generation "
            f"({', '.join(COSTS)}), or load measured ones with bench.vmm_costs.load(path)"
        )
    return COSTS[gen].for_chunk(chunk_size)


CALLS = {"create": "cuMemCreate", "map": "cuMemMap", "set_access": "cuMemSetAccess", "unmap": "cuMemUnmap",
         "release": "cuMemRelease"}


def load(path: Union[str, Path], chunk_size: int = 2 * MiB) -> VmmCosts:
    """Costs measured on a GPU (Note [vmm_latency.json]), at the measured chunk size nearest ``chunk_size``."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    results = data.get("results_us")
    if not isinstance(results, dict) or not results:
        raise ValueError(f"{path} is not a VMM latency file (no 'results_us'; see Note [vmm_latency.json])")
    table = []
    for mib, calls in sorted(results.items(), key=lambda kv: int(kv[0])):
        per_op = []
        for call in CALLS.values():
            rec = calls.get(call)
            if not rec or "median_us" not in rec:
                raise ValueError(f"{path}: no median for {call} at {mib} MiB")
            per_op.append(float(rec["median_us"]) * US)
        table.append((int(mib) * MiB, tuple(per_op)))
    device = data.get("environment", {}).get("device", "measured")
    first = table[0]
    base = VmmCosts(f"{device} (measured)", f"{path}, per measured chunk size", first[0], *first[1],
                    by_size=tuple(table))  # fmt: skip
    return base.for_chunk(chunk_size)


# Hopper from the first real GPU run (Note [VMM cost figures]); the A100 figures where that file is absent.
_HOPPER_FILE = Path(__file__).resolve().parent / "results" / "gpu" / "NVIDIA_H200" / "vmm_latency.json"
if _HOPPER_FILE.exists():
    COSTS["hopper"] = replace(load(_HOPPER_FILE), name="H100/H200 (measured on an H200)",
                              source="bench/results/gpu/NVIDIA_H200/vmm_latency.json (make gpu, driver 580.159)")
