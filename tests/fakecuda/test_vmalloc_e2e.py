"""vmalloc's cuda backend on the emulated driver, end to end: random malloc / free / record_stream /
empty_cache on three streams under capacity pressure (so chunks are reclaimed and remapped), with every
allocation's bytes written by stream work and checked by stream work, every hand-out checked by the race
detector, and nothing left in the driver once the arena is gone.

It runs in a fresh process, because VMALLOC_LIBCUDA is read when the cuda backend first loads its driver."""

import json

import pytest

from fakecuda.build import ensure_built
from fakecuda.isolated import run_isolated

WORKLOAD = """
    import gc, json, random
    import fakecuda, vmalloc

    fc = fakecuda.driver()
    MiB = 1 << 20
    streams = [0, fc.stream(), fc.stream(nonblocking=True)]
    arena = vmalloc.Arena("cuda", capacity="64MiB", chunk_size="2MiB", small_max="256KiB")
    rng = random.Random(1234)
    live = {}  # addr -> (size, stream, byte)
    ops = {"malloc": 0, "free": 0, "oom": 0, "record_stream": 0, "empty_cache": 0, "host_checks": 0}

    def free(addr):
        size, stream, byte = live.pop(addr)
        fc.expect(stream, addr, size, byte)  # stream work checks the data before the free
        arena.free(addr)
        ops["free"] += 1

    for step in range(1500):
        r = rng.random()
        if live and (r < 0.42 or len(live) > 24):
            free(rng.choice(sorted(live)))
        elif r < 0.44:
            arena.empty_cache()
            ops["empty_cache"] += 1
        else:
            size = rng.choice([rng.randint(1, 256 << 10), rng.randint(256 << 10, 12 * MiB)])
            stream = rng.choice(streams)
            try:
                addr = arena.malloc(size, stream)
            except vmalloc.OutOfMemoryError:
                ops["oom"] += 1
                continue
            ops["malloc"] += 1
            fc.check_reuse(stream, addr, size)
            byte = step % 251 + 1
            fc.fill(stream, addr, size, byte, rng.choice([0, 0, 0, 2000]))
            if rng.random() < 0.15:
                # Use the block on another stream as well, ordered after the fill, and tell the allocator.
                other = rng.choice([s for s in streams if s != stream])
                e = fc.event()
                fc.record(e, stream)
                fc.wait_event(other, e)
                fc.expect(other, addr, size, byte, 1000)
                fc.destroy_event(e)
                arena.record_stream(addr, other)
                ops["record_stream"] += 1
            if rng.random() < 0.05:
                fc.synchronize(stream)
                assert fc.peek(addr, size) == bytes([byte]) * size, "data read on the host differs"
                ops["host_checks"] += 1
            live[addr] = (size, stream, byte)
        if step % 100 == 0:
            arena.check_invariants()

    for addr in sorted(live):
        free(addr)
    stats = arena.stats()
    probe = arena.maps_at_offsets  # asked already by the first block: cached, no driver call
    arena.check_invariants()
    del arena
    gc.collect()
    fc.ctx_synchronize()
    for s in streams[1:]:
        fc.destroy_stream(s)
    fc.drain()
    print(json.dumps({"ops": ops, "violations": fc.violations(), "misuses": fc.misuses(), "live": fc.live(),
                      "used": fc.used_bytes(), "retains": fc.primary_retains(),
                      "calls": {n: fc.calls(n) for n in ("cuMemMap", "cuMemUnmap", "cuMemCreate", "cuMemRelease",
                                                         "cuEventSynchronize", "cuStreamWaitEvent")},
                      "reclaimed": stats["num_reclaimed_chunks"], "unmaps": stats["num_unmaps"],
                      "maps": stats["num_maps"], "mapped_chunks": stats["num_mapped_chunks"],
                      "block_size": stats["block_size"], "maps_at_offsets": probe}))
"""


MiB = 1 << 20


@pytest.mark.parametrize("offsets", ["1", "0"])
def test_cuda_arena_on_the_emulated_driver(offsets):
    """With FAKECUDA_MAP_OFFSETS=0 the driver refuses cuMemMap at a nonzero offset (cuda.h's "currently must
    be zero"): the backend's probe sees it and the arena makes every block one chunk (Note [Probing map
    offsets]); otherwise runs of a block's chunks map with one call each (Note [Blocks and slices])."""
    proc = run_isolated(WORKLOAD, VMALLOC_LIBCUDA=str(ensure_built()), FAKECUDA_MAP_OFFSETS=offsets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["violations"] == [], "\n\n".join(out["violations"])
    # vmalloc broke no driver rule; the probe's map at an offset is refused when offsets are (once).
    assert [m for m in out["misuses"] if "currently must be zero" not in m] == []
    assert len(out["misuses"]) == (offsets == "0")
    assert out["live"] == {"allocations": 0, "mappings": 0, "reservations": 0, "streams": 0, "events": 0}
    assert out["used"] == 0 and out["retains"] == 1  # only the test's own retain of the primary context
    ops = out["ops"]
    assert ops["malloc"] > 500 and ops["free"] == ops["malloc"] and ops["record_stream"] > 50
    # Capacity pressure made the arena unmap and remap chunks, each unmap fenced by an event sync. The driver
    # saw every map the arena made and the probe's, and an unmap for each that succeeded (the arena's last
    # ones in its destructor).
    calls, probe_mapped = out["calls"], int(offsets == "1")
    assert out["reclaimed"] > 0 and out["maps"] > 50
    assert calls["cuMemMap"] == out["maps"] + 1 and calls["cuMemUnmap"] == out["maps"] + probe_mapped
    assert out["calls"]["cuEventSynchronize"] > 0 and out["calls"]["cuStreamWaitEvent"] >= ops["record_stream"]
    assert out["maps_at_offsets"] == (offsets == "1")  # what bench.gpu.vmm_latency records on a real driver
    if offsets == "1":
        assert out["block_size"] == 32 * MiB and out["maps"] < out["mapped_chunks"]
    else:
        assert out["block_size"] == 2 * MiB and out["maps"] == out["mapped_chunks"]
