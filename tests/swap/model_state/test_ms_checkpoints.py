"""Checkpoints in a real loop under the default strategy: ``model.state_dict()`` brings no weight to the device (a
model larger than the device can be saved, and the next iteration keeps the budget), and a checkpoint loaded
inside the manager (a Hugging Face GPT-2, its keys in a file's order) trains on bitwise as plain torch resumes."""

import io

import pytest
import torch
from ms_training import gpt, same_bits, train

import swap

SPLIT = 2


def test_saving_inside_the_manager_fetches_no_weight():
    """A checkpoint at every step: its values are plain torch's, and saving it brings no weight to the device
    (no demand fetch; the live bytes do not grow while it is taken)."""
    meter = swap.LiveBytesMeter("cpu")
    ref = train(gpt, meter=meter, steps=3)
    budget = int(0.5 * meter.peak)
    weights = sum(p.numel() * p.element_size() for p in gpt().parameters())
    saved: dict[str, list] = {"plain": [], "managed": []}
    growth: list[int] = []

    def saver(kind, meter=None):
        def hook(step, model, opt, sched):
            live = meter.live if meter is not None else 0
            if meter is not None:
                meter.reset_window()
            sd = model.state_dict()
            if meter is not None:
                growth.append(meter.reset_window() - live)
            # .numpy(), no operator: the meter must not start counting the host masters (host memory) here
            saved[kind].append({k: v.numpy().copy() for k, v in sd.items()})

        return hook

    def manager(model, opt):
        return swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB",
                                min_bytes="4KiB")  # fmt: skip

    train(gpt, steps=3, step_hook=saver("plain"))
    meter = swap.LiveBytesMeter("cpu")
    got = train(gpt, steps=3, meter=meter, manager=manager, step_hook=saver("managed", meter))
    assert got["losses"] == ref["losses"]
    for a, b in zip(saved["plain"], saved["managed"]):
        assert list(a) == list(b)
        assert all(same_bits(a[k], b[k]) for k in a), "a saved value differs from plain torch's"
    assert got["manager"].report()["model_state"]["demand_fetches"] == 0, "model.state_dict() fetched weights"
    assert max(growth) < weights // 8, f"saving grew the live bytes by {growth} ({weights} bytes of weights)"


# -- loading inside the manager ---------------------------------------------------------------------------------
def hf_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).train()


def hf_run(steps, checkpoint=None, manager=False, save_after=None):
    """Steps of a tiny GPT-2 (AdamW with the fused kernel, the one the host step runs: Note [The host kernel]);
    ``"load"`` in ``steps`` loads ``checkpoint`` there. Returns the final parameters and optimizer state, and the
    checkpoint taken after step ``save_after`` (its keys sorted, as a safetensors file orders them)."""
    model = hf_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    sm = None
    if manager:
        sm = swap.SwapManager(budget="1GiB", device="cpu", model=model, optimizer=opt, bucket_bytes="64KiB")
    out = {}
    with sm if sm is not None else torch.enable_grad():
        for step in steps:
            if step == "load":
                ck = torch.load(io.BytesIO(checkpoint), weights_only=True)
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
                continue
            torch.manual_seed(1000 + step)  # dropout's masks, as a resumed run draws them
            idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))
            model(input_ids=idx, labels=idx).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == save_after:
                buf = io.BytesIO()
                torch.save({"model": dict(sorted(model.state_dict().items())), "opt": opt.state_dict()}, buf)
                out["checkpoint"] = buf.getvalue()
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    out["state"] = [{k: v.numpy().copy() for k, v in s.items()} for s in opt.state_dict()["state"].values()]
    return out


def assert_same_run(a, b):
    assert all(same_bits(x, y) for x, y in zip(a["params"], b["params"])), "parameters differ"
    assert len(a["state"]) == len(b["state"])
    for sa, sb in zip(a["state"], b["state"]):
        assert all(same_bits(sa[k], sb[k]) for k in sa), "optimizer state differs"


@pytest.mark.parametrize("steps", [["load", 2, 3, 4], [0, "load", 2, 3, 4]], ids=["at-entry", "mid-profiling"])
def test_loading_a_checkpoint_inside_the_manager_then_training_is_plain_resume(steps):
    """The load's reads (in the file's key order) are no forward use: the buckets are re-packed in the forward's
    order, and the executor's variables of buckets that re-packing removed are not asked about (the IndexError
    in streaming's on_device)."""
    ref = hf_run(range(5), save_after=SPLIT - 1)
    plain = hf_run(["load", *steps[steps.index("load") + 1 :]], ref["checkpoint"])
    assert_same_run(ref, plain)  # plain torch resumes bitwise: the reference
    assert_same_run(ref, hf_run(steps, ref["checkpoint"], manager=True))
