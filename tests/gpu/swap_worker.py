"""The swap runtime on CUDA in one process per allocator: trains without swapping, then under a budget of
60% of that run's peak (raised to 1.05 x the smallest feasible budget where 60% is below it), and prints one
JSON line (gradient digests, peaks by the allocator's own statistics and by the cuda-python oracle, reserved
memory after each iteration). tests/gpu/test_swap_cuda.py drives it.

    python swap_worker.py {vmalloc,vmalloc_pool,native} [--model resnet|gpt] [--policy window|...]
        [--iterations N] [--lag] [--out FILE]

vmalloc: vmalloc is torch's allocator (global mode); vmalloc_pool: torch's allocator with every allocation of
both runs in a vmalloc pool (vmalloc.use_mem_pool); native: torch's allocator alone. --lag delays every copy
of the swap engine (Note [Late copies] in bench/gpu/lag.py) and collects garbage between iterations (a variable
dropped without its fence: ../shared/notes/model-state-review.md row 20), so the results must stay bitwise with
copies late; --out also writes the JSON line's object to FILE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {  # builder, batch, input size: activations of tens of MiB, a few seconds per run on an H100
    "resnet": (lambda m: m.resnet((2, 2, 2, 2), width=32, num_classes=10), 32, 96),
    "gpt": (lambda m: m.gpt(n_layer=4, n_head=8, d_model=256, vocab=1024, seq_len=256), 16, 256),
}


def train(
    name: str,
    iterations: int,
    manager: Optional[Any] = None,
    poller: Optional[Any] = None,
    reserved: Optional[Callable[[], int]] = None,
    collect: bool = False,
) -> dict[str, Any]:
    """Trains ``name``; ``reserved()`` (the allocator's reserved bytes) is read after each iteration."""
    import contextlib

    import torch

    from swap.forecast import zoo as models

    build, batch, size = MODELS[name]
    torch.manual_seed(0)
    model = build(models).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    from cuda_oracle import used_bytes

    losses, digests, held, outside = [], [], [], []
    entered: Optional[int] = None
    with contextlib.ExitStack() as stack:
        if manager is not None:
            stack.enter_context(manager)
            if reserved is not None:  # the driver's memory outside the allocator once the runtime is set up
                torch.cuda.synchronize()
                entered = used_bytes() - reserved()
        for it in range(iterations):
            x, y = models.example_batch(model, batch, size, torch.Generator().manual_seed(it), device="cuda")
            if poller is not None and it == iterations - 1:
                stack.enter_context(poller)  # the last (planned) iteration, under the oracle
            loss = models.loss_fn(model, model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(repr(loss.item()))
            d = hashlib.sha256()
            for p in model.parameters():
                d.update(p.grad.detach().cpu().numpy().tobytes())
            digests.append(d.hexdigest())
            opt.step()
            del loss, x, y
            if collect:
                import gc

                gc.collect()
            if reserved is not None:
                torch.cuda.synchronize()
                held.append(reserved())
                outside.append(used_bytes() - held[-1])  # the driver's memory that is not the allocator's
    from cuda_oracle import vmm_backed

    # Whether the parameters live in driver VMM mappings (vmalloc's chunks), checked while they are alive.
    vmm = all(vmm_backed(p.data_ptr()) for p in model.parameters())
    return {"losses": losses, "grad_sha256": digests, "params_vmm_backed": vmm, "reserved_per_iteration": held,
            "outside_per_iteration": outside, "outside_after_enter": entered}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("allocator", choices=["vmalloc", "vmalloc_pool", "native"])
    p.add_argument("--model", choices=sorted(MODELS), default="resnet")
    p.add_argument("--policy", default="window")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--lag", action="store_true", help="every copy of the swap engine late (bench/gpu/lag.py)")
    p.add_argument("--out", type=Path, help="also write the result to this file")
    args = p.parse_args(argv)

    import contextlib

    import torch

    import vmalloc

    from cuda_oracle import make_context_current

    # Note [Deterministic kernels, strictly]
    # Bitwise equal gradients need every kernel deterministic, and warn_only=True is not enough: it only warns
    # where torch has no deterministic kernel, and some kernels choose their deterministic path only in the
    # strict mode. The GPT's attention is one (fp32 scaled_dot_product_attention on an H100/H200 runs the
    # memory-efficient kernel, whose backward splits the 256 keys over several blocks that add into the query
    # gradient with atomics unless the mode is strict): on an H200 one GPT run's gradients differed from the
    # unswapped run's at one iteration while the losses agreed. Strict mode makes it split nothing, and
    # raises, naming the operator, where a model here has no deterministic kernel (none does: cross-entropy
    # over (rows, classes) reduces in one block, adaptive_avg_pool2d to 1x1 is a mean).
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    out: dict[str, Any] = {"allocator": args.allocator, "model": args.model, "policy": args.policy, "lag": "off"}
    if args.lag:
        from bench.gpu import lag

        lag.install()
        out["lag"] = f"{lag.DEFAULT_CYCLES} cycles before every copy, gc.collect() after every iteration"
    scope: Any = contextlib.nullcontext()
    if args.allocator == "vmalloc":
        # The budget comes from this process's own no-swap run (the allocator is process-wide).
        torch.cuda.memory.change_current_allocator(vmalloc.allocator())
    elif args.allocator == "vmalloc_pool":
        scope = vmalloc.use_mem_pool(vmalloc.mem_pool())  # both runs, every thread's allocations
    make_context_current(0)
    with scope:
        run(args, out)
    print("RESULT " + json.dumps(out))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch

    import swap
    import vmalloc

    from cuda_oracle import UsedMemoryPoller, stack_size

    global_mode = args.allocator == "vmalloc"

    def reserved() -> int:
        return vmalloc.global_arena(0).reserved_bytes if global_mode else torch.cuda.memory_reserved(0)

    base = train(args.model, args.iterations)
    peak = vmalloc.stats(0)["allocated_bytes.all.peak"] if global_mode else torch.cuda.max_memory_allocated(0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # 60% of the peak, unless that is below what any plan needs (cuBLAS/cuDNN workspaces count in the peak):
    # then 1.05 x the smallest budget the manager names (e.min_budget), and the swapped run starts over.
    budget = int(0.6 * peak)
    out.update(no_swap_peak=peak, base=base)
    for attempt in range(2):
        if global_mode:
            vmalloc.global_arena(0).set_capacity(budget)  # physical memory itself is capped at the budget
            budget = vmalloc.global_arena(0).stats()["capacity"]  # rounded down to whole chunks
            vmalloc.global_arena(0).reset_peak_stats()
        else:
            torch.cuda.reset_peak_memory_stats(0)
        baseline_used = UsedMemoryPoller(0, held=reserved)
        baseline_used.sample()
        stack_before = stack_size()
        poller = UsedMemoryPoller(0, held=reserved)
        sm = swap.SwapManager(budget=budget, policy=args.policy, min_bytes="256KiB")
        try:
            swapped = train(args.model, args.iterations, manager=sm, poller=poller, reserved=reserved,
                            collect=args.lag)
            break
        except swap.InfeasibleBudget as e:
            if attempt:
                raise
            out["infeasible_at"] = budget
            budget = max(budget, int(1.05 * e.min_budget))
            del e  # its traceback holds the failed run's model and tensors
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    out["budget"] = budget
    report = sm.report()
    out["swapped"] = swapped
    out["report"] = {k: report.get(k) for k in ("peak_device_bytes", "budget_bytes", "swapped_out_bytes",
                                                "demand_fetches", "declined", "memory_source", "overruns",
                                                "replans", "evictions")}  # fmt: skip
    if global_mode:
        s = vmalloc.stats(0)
        out["allocator_peak_allocated"] = s["allocated_bytes.all.peak"]
        out["allocator_peak_reserved"] = s["reserved_bytes.all.peak"]
    else:
        # The manager never resets torch's peak (TorchCudaMemory): it is the run's peak since the reset above.
        out["allocator_peak_allocated"] = torch.cuda.max_memory_allocated(0)
        out["allocator_peak_reserved"] = torch.cuda.max_memory_reserved(0)
    # Note [The oracle from the last iteration's start]
    # The oracle: device memory the driver reports in use during the last (planned) iteration, relative to its
    # start, plus what the allocator held then. It counts everything (workspaces, other allocations), so it
    # bounds the allocator's physical peak from above. It was measured from before the swapped run, and on an
    # H200 read 70 MiB (73,400,320 B) above the budget for vmalloc-resnet and vmalloc-gpt while vmalloc's own
    # reserved peak held the budget. That was the driver's memory, not the allocator's: torch's own allocator
    # (native-resnet, --lag) showed the same 73,400,320 B outside its reserved bytes, the per-thread stack limit
    # stayed at 1024 B, and the memory outside the allocator after each swapped iteration was one figure to
    # the byte (812,449,792 B) over all four: it grew once, as the runtime began, by the same amount for
    # both models and both allocators (so not kernels of the model loaded lazily), and never again. What the
    # driver made is not named by these figures (a guess: the swap engine's first torch.cuda.Stream() creates
    # torch's whole stream pool, 32 streams per priority); ``outside_after_enter`` says whether it comes with
    # the manager's setup or with the first swapped iteration. So the oracle starts at the last iteration,
    # after that one-time growth (reported as ``oracle_outside_setup``), and a growth while it runs, ours or
    # the driver's, still counts in full; ``outside_per_iteration`` shows any growth from one iteration to
    # the next (test_swap_cuda.py holds it flat).
    out["oracle_peak_bytes"] = poller.peak - poller.start_used + poller.start_held
    out["oracle_samples"] = poller.samples
    # Where the oracle's excess lies (Note [What the oracle counts] in tests/gpu/cuda_oracle.py): device memory
    # the driver reports in use beyond the allocator's reserved bytes, at its highest in the last iteration
    # less at its start; the same at the last iteration's start less before the swapped run (the one-time
    # growth); and the per-thread stack (local memory) limit before and after.
    out["oracle_outside_growth"] = poller.outside_peak - (poller.start_used - poller.start_held)
    out["oracle_outside_setup"] = (poller.start_used - poller.start_held) - baseline_used.outside_peak
    entered = swapped.get("outside_after_enter")
    out["outside_setup_at_enter"] = None if entered is None else entered - baseline_used.outside_peak
    out["stack_size_before_after"] = [stack_before, stack_size()]


if __name__ == "__main__":
    sys.exit(main())
