"""Under mixed precision each master's compute-dtype copy is cast once per change of the master, not at every fetch
(Note [One cast per master change] in swap/runtime/model_state/storage.py): a streamed run fetches every bucket
in every forward and backward, and casts only after a host step; a write to a master a state dict handed out is
cast again. Bitwise equality with the reference loop is test_ms_mixed_precision.py's."""

import torch
from ms_training import batch, gpt, groups, loss_of

import swap

BF16 = torch.bfloat16
STEPS, ACCUM = 3, 2


def manager(model, opt, speculate=True):
    policy = swap.ModelStatePolicy(placement="streamed", bucket_bytes="32KiB", compute_dtype=BF16)
    sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, model_state=policy,
                          min_bytes="4KiB")  # fmt: skip
    sm.model_state.speculate = speculate
    return sm


def test_each_master_is_cast_once_a_step_though_fetched_every_pass():
    torch.manual_seed(0)
    model = gpt()
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    sm = manager(model, opt, speculate=False)  # speculation's rollbacks would add casts of their own
    casts = []
    with sm:
        ms = sm.model_state
        mixed = sum(ms.masters.mixed(e) for e in ms.entries)
        assert mixed == len(ms.entries) > 1 and ms.masters.casts == mixed  # the first copies, made at the start
        nbytes = sum(e.nbytes for e in ms.entries)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(ACCUM):
                before = ms.masters.casts
                x, y = batch(model, step * 10 + micro)
                (loss_of(model, x, y) / ACCUM).backward()
                casts.append(ms.masters.casts - before)
            opt.step()
        r = sm.report()["model_state"]
    assert all(row["weights_in_bytes"] >= ACCUM * nbytes for row in r["steps"])  # every copy fetched each micro-batch
    # cast again only in the first micro-batch after each host step changed the masters
    assert casts == [0] * ACCUM + ([mixed] + [0] * (ACCUM - 1)) * (STEPS - 1)


def test_a_write_to_a_master_a_state_dict_gave_is_cast_again():
    torch.manual_seed(0)
    model = gpt()
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    name, p = next((n, q) for n, q in model.named_parameters() if q.dim() == 2)
    # no speculation: a speculated step still pending at the write would be rolled back over it, casts or not
    with manager(model, opt, speculate=False):
        x, y = batch(model, 0)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        master = model.state_dict()[name]  # the fp32 host master itself
        assert master.dtype == torch.float32
        loss_of(model, x, y).backward()  # cast again after the step, then current
        opt.zero_grad()
        with torch.no_grad():
            master.mul_(-2.0)  # seen by the master's version counter
            want = master.to(BF16)
            got = p.detach().clone()  # a read between passes fetches the bucket
    assert got.dtype == BF16 and torch.equal(got, want)
