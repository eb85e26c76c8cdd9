"""Tiny Hugging Face models (configs built in code, nothing downloaded) and the training loops people write with
them, run plainly and under ``SwapManager(model=, optimizer=)`` with the default strategy, for
test_user_loops.py. Every run records what must match plain training bitwise (losses, final parameters and
optimizer state) and each iteration's peak as an independent meter sees it.

The budget's judge is tests/swap/sweep_meter.py's SweepMeter, which shares no code with the manager's meter and
re-reads every live storage's size at each operator (Note [Sweeping every storage]): the streamer frees and
refills weights by resizing their storages in place (Note [Device copies by storage resize] in
swap/runtime/model_state/storage.py)."""

from __future__ import annotations

import gc
import io
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

import swap

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/swap: sweep_meter, the budget's judge

SEQ, VOCAB, BATCH = 16, 1024, 2  # the weights dominate the plain peak: model state is what must move


# -- models --------------------------------------------------------------------------------------------------------
def _quiet() -> Any:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers


def gpt2() -> torch.nn.Module:
    t = _quiet()
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                          bos_token_id=0, eos_token_id=0, use_cache=False))  # fmt: skip


def _llama_config() -> Any:
    t = _quiet()
    return t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)  # fmt: skip


def llama() -> torch.nn.Module:
    return _quiet().LlamaForCausalLM(_llama_config())


def llama_frozen() -> torch.nn.Module:
    """The usual fine-tune: embeddings and the first layer frozen, the optimizer still given every parameter."""
    model = llama()
    for name, p in model.named_parameters():
        if name.startswith(("model.embed_tokens.", "model.layers.0.")):
            p.requires_grad_(False)
    return model


def bert() -> torch.nn.Module:
    t = _quiet()
    return t.BertForSequenceClassification(t.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=128,
                                                        max_position_embeddings=SEQ, num_labels=3))  # fmt: skip


def t5() -> torch.nn.Module:
    t = _quiet()
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                   pad_token_id=0, eos_token_id=1, use_cache=False))  # fmt: skip


def vit() -> torch.nn.Module:
    t = _quiet()
    return t.ViTForImageClassification(t.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128, num_labels=5))  # fmt: skip


def switch() -> torch.nn.Module:
    """Switch Transformers (one expert a token, eight experts a layer) fed few tokens: experts that no token
    reached get no gradient in that step, and AdamW skips them."""
    t = _quiet()
    return t.SwitchTransformersForConditionalGeneration(t.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=8, encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, use_cache=False))  # fmt: skip


def lora() -> torch.nn.Module:
    """PEFT's LoRA on the Llama: the base frozen, adapters on the attention projections (``lora_B`` made
    nonzero, so every step changes the output)."""
    import peft

    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": gpt2, "llama": llama, "llama_frozen": llama_frozen, "bert": bert, "t5": t5, "vit": vit,
    "switch": switch, "lora": lora,
}  # fmt: skip


def inputs(arch: str, it: int, n: int = BATCH) -> dict[str, torch.Tensor]:
    """Batch ``it`` of ``arch``'s task, with its labels (a language model's are its inputs)."""
    g = torch.Generator().manual_seed(1000 + it)
    if arch == "vit":
        pixels = torch.randn(n, 3, 16, 16, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, 5, (n,), generator=g)}
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    if arch == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (n,), generator=g)}
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (n, SEQ // 2), generator=g)}
    if arch == "switch":  # few tokens: some experts get none
        return {"input_ids": ids[:, :4], "labels": torch.randint(2, VOCAB, (n, 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


# -- runs ----------------------------------------------------------------------------------------------------------
def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """As users make it: every parameter (frozen ones too), torch's default kernel."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def host_kernel(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Plain training's reference steps with the kernel the host step runs where the user left torch's default
    (fused; Note [The host kernel] in swap/runtime/model_state/host_optim.py)."""
    from ms_training import host_kernel as fused

    return fused(opt)


def copy(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return None if t is None else t.detach().float().cpu().numpy().copy()


class Run:
    """One training run's objects and records: the loop functions in test_user_loops.py fill ``losses``; the
    runner records ``peaks`` (one per iteration) and, at the end, the parameters and optimizer state."""

    def __init__(self, arch: str, model: torch.nn.Module, opt: torch.optim.Optimizer, sm: Any, meter: Any) -> None:
        self.arch, self.model, self.opt, self.sm, self.meter = arch, model, opt, sm, meter
        self.losses: list[float] = []
        self.peaks: list[int] = []
        self.params: list[Optional[np.ndarray]] = []
        self.state: dict[Any, Any] = {}
        self.blob = b""  # a checkpoint the loop took
        self.grads_none: list[bool] = []
        self.report: Any = None

    def loss(self, it: int) -> torch.Tensor:
        return self.model(**inputs(self.arch, it)).loss

    def end_iteration(self) -> None:
        if self.meter is not None:
            self.peaks.append(self.meter.reset_window())

    def finish(self) -> None:
        """Records the results as numpy copies and lets the run's tensors go: on the CPU the budget counts every
        live tensor storage in the process (Note [What the CPU budget counts] in swap/runtime/machine/memory.py), so a
        cached plain run must hold none."""
        self.params = [copy(p) for p in self.model.parameters()]
        self.grads_none = [p.grad is None for p in self.model.parameters()]
        sd = self.opt.state_dict()
        self.state = {i: {k: copy(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in sd["state"].items()}  # fmt: skip
        self.report = None if self.sm is None else self.sm.report()
        self.model = self.opt = self.sm = None


def build(arch: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    gc.collect()
    torch.manual_seed(0)
    model = MODELS[arch]().train()
    return model, adamw(model)


def run(arch: str, loop: Callable[[Run], None], budget: Any = None, meter: Any = None) -> Run:
    """``loop(r)`` on a fresh ``arch`` (seeded), plainly (``budget`` None) or inside
    ``SwapManager(budget=budget, device="cpu", model=, optimizer=)`` with every other setting its default."""
    model, opt = build(arch)
    sm = None
    if budget is None:
        host_kernel(opt)
    else:
        sm = swap.SwapManager(budget=budget, device="cpu", model=model, optimizer=opt)
    r = Run(arch, model, opt, sm, meter)
    if meter is not None:
        meter.__enter__()
        meter.track_existing()
        meter.reset_window()
    try:
        if sm is not None:
            with sm:
                if meter is not None:
                    meter.reset_window()  # from the manager's entry: the model as the user made it may not fit
                loop(r)
        else:
            loop(r)
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
    r.finish()
    del model, opt, sm
    gc.collect()
    return r


def same_bits(x: Optional[np.ndarray], y: Optional[np.ndarray]) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_same(ref: Run, got: Run, losses: bool = True) -> None:
    """Losses (unless ``losses`` is False), parameters and optimizer state identical to the last bit."""
    assert not losses or got.losses == ref.losses, f"losses {got.losses} != plain {ref.losses}"
    bad = [i for i, (x, y) in enumerate(zip(ref.params, got.params)) if not same_bits(x, y)]
    assert not bad, f"{len(bad)} of {len(ref.params)} parameters differ from plain training (first: {bad[:3]})"
    # the same parameters have state; the state dict's key order (which parameter the host stepped first) is not
    # semantics: a load gives every parameter its own state whatever the order
    assert sorted(ref.state) == sorted(got.state), "different parameters have optimizer state"
    for i, st in ref.state.items():
        for k, v in st.items():
            w = got.state[i][k]
            ok = same_bits(v, w) if isinstance(v, np.ndarray) else v == w
            assert ok, f"parameter {i}: optimizer state {k!r} differs from plain training"


def within(got: Run, budget: int) -> None:
    over = [(i, p - budget) for i, p in enumerate(got.peaks) if p > budget]
    assert not over, f"iterations over the budget of {budget} bytes (iteration, bytes over): {over}"


def checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any = None) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": None if sched is None else sched.state_dict()}, buf)  # fmt: skip
    return buf.getvalue()


def load(blob: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob), weights_only=True)
