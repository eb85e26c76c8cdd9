"""Small third-party models for training tests (``training.run``'s build, batch_fn and pattern): Hugging Face
GPT-2 (with dropout on), BERT, T5, a Llama-style decoder and ViT, and the zoo's ResNet with BatchNorm.

The decoders run with ``use_cache=False``, as training with checkpointing does (Hugging Face turns the cache
off itself when its gradient checkpointing is on): a key/value cache is changed by each layer's forward, so
a rerun would change it twice, and the manager does not checkpoint a module given one."""

from __future__ import annotations

from typing import Any, Callable

import torch

from swap.forecast import zoo as models

SEQ, VOCAB = 64, 128


def _ids(it: int, n: int = 8, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(it))


def gpt2(layers: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
                     eos_token_id=0, attn_implementation="eager", use_cache=False)  # dropout stays on  # fmt: skip
    return GPT2LMHeadModel(cfg)


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                     intermediate_size=256, max_position_embeddings=SEQ, attn_implementation="eager")  # fmt: skip
    return BertForSequenceClassification(cfg)


def t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False)  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=3,
                    num_attention_heads=4, intermediate_size=128, num_labels=5,
                    attn_implementation="eager")  # fmt: skip
    return ViTForImageClassification(cfg)


def resnet() -> torch.nn.Module:
    return models.resnet((2, 2), width=8, num_classes=10)


def _lm_batch(model: Any, it: int) -> tuple[Any, Any]:
    x = _ids(it)
    return x, x


def _lm_step(model: Any, x: Any, y: Any, it: int) -> torch.Tensor:
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    return loss


def _cls_batch(model: Any, it: int) -> tuple[Any, Any]:
    return _ids(it), torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(100 + it))


def _t5_batch(model: Any, it: int) -> tuple[Any, Any]:
    return _ids(it), _ids(1000 + it, seq=16)


def _image_batch(model: Any, it: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g)


def _vit_step(model: Any, x: Any, y: Any, it: int) -> torch.Tensor:
    loss = model(pixel_values=x, labels=y).loss
    loss.backward()
    return loss


def _cnn_batch(model: Any, it: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(it)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def _cnn_step(model: Any, x: Any, y: Any, it: int) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


# name -> (build, batch_fn, pattern): keyword arguments of training.run
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable, Callable]] = {
    "gpt2": (gpt2, _lm_batch, _lm_step),
    "bert": (bert, _cls_batch, _lm_step),
    "t5": (t5, _t5_batch, _lm_step),
    "llama": (llama, _lm_batch, _lm_step),
    "vit": (vit, _image_batch, _vit_step),
    "resnet_bn": (resnet, _cnn_batch, _cnn_step),
}


def run_kwargs(name: str) -> dict[str, Any]:
    build, batch_fn, pattern = MODELS[name]
    return {"build": build, "batch_fn": batch_fn, "pattern": pattern}
