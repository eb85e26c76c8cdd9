"""At the manager's exit no copy reads host memory already returned (Note [Host memory outlives its copies]): with
the weights' copies back to the device made late, as a busy copy stream makes them on a GPU, every one still runs
before the host masters' pool closes, and the parameters after the exit are the masters'."""

import threading
import time

import torch
from ms_training import batch, gpt, loss_of

import swap
import swap.runtime.manager as manager_module
from swap.runtime.machine.engines import HostEngine

STREAMED = swap.ModelStatePolicy(placement="streamed")


class LateEngine(HostEngine):
    """A host engine whose copies to the device, once ``late`` is set, run behind a delay on their worker, and whose
    ``wait_compute`` does not block the host (it orders the copy before the compute only, as on a device): each
    such copy records whether any of ``pools`` was closed when it ran."""

    def __init__(self) -> None:
        super().__init__(inline_bytes=0)  # every copy on a worker
        self.late = False
        self.pools: list = []
        self.after_close: list[int] = []
        self.lock = threading.Lock()

    def h2d(self, dst, src, after=None):
        if not self.late:
            return super().h2d(dst, src, after)
        pools = self.pools

        def delayed() -> None:
            time.sleep(0.02)
            if any(p.closed for p in pools):
                with self.lock:
                    self.after_close.append(src.numel())

        self._h2d.submit(delayed)
        return super().h2d(dst, src, after)

    def wait_compute(self, ticket):
        return 0.0 if self.late else super().wait_compute(ticket)


def test_no_copy_reads_the_host_masters_after_the_exit_returned_them(monkeypatch):
    engine = LateEngine()
    plain = manager_module.open_resources

    def open_resources(device, arena, host_pool_limit):
        memory, first, pool = plain(device, arena, host_pool_limit)
        first.close()
        return memory, engine, pool

    monkeypatch.setattr(manager_module, "open_resources", open_resources)
    expected = train_two_steps(None).state_dict()
    model = train_two_steps(engine)
    assert engine.after_close == [], f"{len(engine.after_close)} copies ran after the host masters' pool closed"
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def train_two_steps(engine) -> torch.nn.Module:
    """Two steps of SGD without state (fused: the host step's kernel), plainly (``engine`` None) or under the
    manager, with ``engine`` made late just before the exit."""
    torch.manual_seed(0)
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # no state: nothing else waits at the exit
    sm = None
    if engine is not None:
        sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state=STREAMED)
    with sm if sm is not None else torch.enable_grad():
        if engine is not None:
            engine.pools = sm.model_state.pools
        for it in range(2):
            x, y = batch(model, it)
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if engine is not None:
            engine.late = True  # the manager's exit shuts its workers down, waiting for every queued copy
    return model
