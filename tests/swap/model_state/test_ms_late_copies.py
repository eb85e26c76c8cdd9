"""Model state with every copy made at the last moment (Note [Copies at the last moment] in late_copies.py): what
the CPU engine's prompt copies hide.

- A weight read by an operator that is no use of its bucket (the backward of a checkpointed region rerunning its
  operators, a weight a custom ``autograd.Function`` kept on ``ctx``) waits for the bucket's copy in flight (Note
  [Reads of weights in flight] in swap/runtime/model_state/guard.py): without that wait the look-ahead's prefetch
  left the read to find whatever the fresh allocation held, and the gradients, and so the updates, came out wrong
  while every loss of the step was right.
- The mixed-precision loop of the GPU bench (bench/gpu/model_state_gpu.py --fp32-masters: bf16 compute, fp32
  masters, micro-batches accumulated, every bucket streamed and stepped on the host, speculation kept) is bitwise
  its oracle with every copy late: each gradient's copy, its upcast and accumulation, the host steps and the
  weights' copies back wait for what they read."""

import contextlib
import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from late_copies import install
from ms_training import assert_same_state, batch, gpt, groups, host_kernel, loss_of, state_arrays
from ms_training import copy as array
from torch.utils.checkpoint import checkpoint

import swap

BF16 = torch.bfloat16


class Twice(torch.autograd.Function):
    """``2 x @ w.T``, keeping ``w`` on ``ctx`` (no saved tensor: its backward reads it with no use of its bucket)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        ctx.save_for_backward(x)
        return F.linear(x, w) * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        g = g * 2
        return g @ ctx.w, g.flatten(0, -2).T @ x.flatten(0, -2)


class Net(torch.nn.Module):
    """Four linear layers; the second one's weight is read outside its module, in a checkpointed function
    (``how="checkpoint"``: the backward reruns it) or through ``Twice`` (``how="ctx"``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.tok = torch.nn.Embedding(64, 256)
        self.lin1, self.lin2, self.lin3 = (torch.nn.Linear(256, 256) for _ in range(3))
        self.head = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(self.tok(x))
        if self.how == "checkpoint":
            h = checkpoint(lambda t: F.linear(t, self.lin2.weight) * 2, h, use_reentrant=False)
        else:
            h = Twice.apply(h, self.lin2.weight)
        return self.head(torch.relu(self.lin3(h)))


def train_net(how: str, managed: bool, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net(how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # the host step's kernel
    sm = None
    if managed:
        policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes="64KiB")
        sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, min_bytes="4KiB",
                              model_state=policy)  # fmt: skip
    losses = []
    with sm if sm is not None else contextlib.nullcontext():
        for it in range(steps):
            g = torch.Generator().manual_seed(it)
            x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["checkpoint", "ctx"])
def test_a_weight_read_with_no_use_waits_for_its_copy_in_flight(monkeypatch, how):
    plain = train_net(how, managed=False)
    engines = install(monkeypatch)
    losses, params = train_net(how, managed=True)
    assert engines and engines[0].waited_late > 0  # the copies did run late
    assert losses == plain[0]
    wrong = [i for i, (a, b) in enumerate(zip(params, plain[1])) if not torch.equal(a, b)]
    assert not wrong, f"parameters {wrong} differ from plain training's (a weight read before its copy landed)"


STEPS, ACCUM = 3, 2


def train_mixed(managed: bool) -> dict:
    """The GPU bench's mixed-precision loop on a small GPT: fp32 masters, bf16 compute, ``ACCUM`` micro-batches a
    step, AdamW; without the manager, its oracle (bench/gpu/mixed_precision.py): compute copies cast from the masters
    before each micro-batch, their gradients upcast and added to the masters' in fp32."""
    gc.collect()  # the CPU budget counts every live storage: the earlier tests' cycles go first
    torch.manual_seed(0)
    model = gpt(n_layer=3)
    opt = torch.optim.AdamW(groups(model), lr=3e-3, weight_decay=0.1)
    pairs, compute, sm = [], model, None
    if managed:
        policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes="32KiB")
        sm = swap.SwapManager(budget="500KiB", device="cpu", model=model, optimizer=opt, min_bytes="4KiB",
                              compute_dtype=BF16, model_state=policy)  # fmt: skip
    else:
        host_kernel(opt)
        compute = copy.deepcopy(model).to(BF16)
        pairs = list(zip(model.parameters(), compute.parameters()))
    losses = []
    with sm if sm is not None else contextlib.nullcontext():
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            for micro in range(ACCUM):
                with torch.no_grad():
                    for master, c in pairs:
                        c.copy_(master)
                x, y = batch(model, step * 100 + micro)
                loss = loss_of(compute, x, y)
                (loss / ACCUM).backward()
                losses.append(loss.item())
                for master, c in pairs:
                    g = c.grad.float()
                    master.grad = g if master.grad is None else master.grad.add_(g)
                    c.grad = None
            opt.step()
    out = {"losses": losses, "params": [array(p) for p in model.parameters()], "state": state_arrays(opt.state_dict())}
    if sm is not None:
        out["report"] = sm.report()
    return out


def test_the_benchs_mixed_precision_loop_is_bitwise_its_oracle_under_late_copies(monkeypatch):
    oracle = train_mixed(managed=False)
    engines = install(monkeypatch)
    got = train_mixed(managed=True)
    ms = got["report"]["model_state"]
    assert ms["precision"] == "mixed bf16 compute / fp32 master"
    assert ms["speculation"]["kept"] > 0  # the steady steps keep their speculation, as on the GPU
    assert engines[0].waited_late > 0
    assert got["losses"] == oracle["losses"]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got["params"], oracle["params"]))
    assert_same_state(oracle["state"], got["state"])
