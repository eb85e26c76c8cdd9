"""Replays a schedule as a state machine and checks that the executor could follow it."""

from swap import Schedule, Sequence


def check_schedule(seq: Sequence, s: Schedule) -> None:
    n = len(seq)
    ends = seq.ends()  # a variable is gone at its end (after its last access, or when freed)
    pinned: dict[int, int] = {}  # var -> first step the backward node that used it no longer holds it
    resident: set[int] = set()
    host: set[int] = {v for v, c in enumerate(seq.clean) if c}  # a clean variable's home is the host
    for i in range(n):
        for v in list(resident):
            if ends[v] <= i:
                resident.discard(v)
        for v in s.release[i]:
            assert v in resident, f"step {i}: release of v{v}, which is not resident"
            assert v in host, f"step {i}: release of v{v}, whose copy was never started"
            held = seq.held_until[v]
            assert held <= i, f"step {i}: release of v{v}, which the forward holds until step {held}"
            assert pinned.get(v, 0) <= i, f"step {i}: release of v{v}, which its backward node still holds"
            resident.discard(v)
        for v in s.swap_in[i]:
            assert v not in resident, f"step {i}: swap-in of resident v{v}"
            assert v in host, f"step {i}: swap-in of v{v}, which has no host copy"
            resident.add(v)
        v = seq.var[i]
        if seq.swappable[v]:
            if seq.kind[i] == "save":
                resident.add(v)  # a save (re-)attaches the device tensor the forward passes in
            assert v in resident, f"step {i}: v{v} used while not on the device"
            if seq.kind[i] != "save" and seq.node_last[i] > i:
                pinned[v] = seq.node_last[i] + 1
        for u in s.swap_out[i]:
            assert u in resident, f"step {i}: swap-out of v{u}, which is not on the device"
            host.add(u)
        got = sum(seq.sizes[u] for u in resident)
        assert got == s.resident[i], f"step {i}: resident {got} != planned {s.resident[i]}"
        assert seq.nonswap[i] + got <= s.budget, f"step {i}: {seq.nonswap[i] + got} over budget {s.budget}"
