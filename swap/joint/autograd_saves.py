"""Which operators' autograd nodes save their own output, read from the installed torch's derivatives table.

Note [Operators that save their output]
A trace (Note [Operator table from a trace]) shows the saves between two operators' events but not whose they
are: the first operator's saved outputs, or the next one's saved inputs. Autograd saves an output only when a
gradient formula reads it: ``relu`` and ``sigmoid`` read ``result``; ``elu``, ``hardtanh`` (ReLU6),
``leaky_relu`` and ``threshold`` read ``self``, while their in-place forms ``elu_`` and ``leaky_relu_`` read
``result``; ``native_layer_norm`` reads its second and third outputs (mean, rstd), not its first. A list kept
by hand drifts from torch; torch ships the table its autograd code is generated from
(``torchgen/packaged/autograd/derivatives.yaml``), so the answer is read from there: an operator saves its
first output when a gradient formula (not a ``result:`` forward-mode formula) names that output. An in-place
overload without an entry of its own (``relu_``, ``sigmoid_``) is generated from the out-of-place one's formula,
where ``result`` is the tensor it wrote. Without torchgen (a stripped install) a short list stands in.
"""

from __future__ import annotations

import functools
import os
import re

# When the table cannot be read: the common activations and attention kernels that save their output.
FALLBACK = re.compile(r"aten\.(relu_?|sigmoid_?|tanh_?|exp_?|expm1_?|sqrt_?|rsqrt_?|reciprocal_?|tan_?|_softmax"
                      r"|_log_softmax|elu_|leaky_relu_|logsumexp|amax|amin|prod|std|linalg_vector_norm"
                      r"|_scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)\.")  # fmt: skip

# Keys of a derivatives.yaml entry that are not gradient formulas.
NOT_GRADIENTS = {"name", "output_differentiability", "dispatch"}


def _returns(signature: str) -> list[str]:
    """The names the formulas use for an operator's outputs: ``result`` for one, ``result0``... for unnamed
    tuples, else the schema's own names (``output``, ``logsumexp``)."""
    ret = signature.split("->", 1)[1].strip()
    parts = [p.strip() for p in ret[1:-1].split(",")] if ret.startswith("(") else [ret]
    names = []
    for n, part in enumerate(parts):
        words = part.split()
        names.append(words[1] if len(words) > 1 else ("result" if len(parts) == 1 else f"result{n}"))
    return names


@functools.cache
def _table() -> dict[str, bool] | None:
    """``base.overload`` -> whether a gradient formula reads the first output; None without the table."""
    try:
        import torchgen
        import yaml
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "autograd", "derivatives.yaml")
    try:
        with open(path) as f:
            entries = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml's: 10x faster
    except OSError:
        return None
    table = {}
    for entry in entries:
        signature = entry["name"]
        base, _, overload = signature.split("(", 1)[0].partition(".")
        formulas = dict(entry)
        if isinstance(entry.get("dispatch"), dict):
            formulas.update(entry["dispatch"].get("Default", {}))
        gradients = [str(v) for k, v in formulas.items()
                     if k not in NOT_GRADIENTS and not re.fullmatch(r"result\d*", str(k))]  # fmt: skip
        first = re.compile(rf"\b{re.escape(_returns(signature)[0])}\b")
        table[f"{base}.{overload or 'default'}"] = any(first.search(g) for g in gradients)
    return table


@functools.cache
def saves_first_output(name: str) -> bool:
    """Whether the autograd node of operator ``name`` (``aten.relu.default``) saves its first output
    (Note [Operators that save their output])."""
    table = _table()
    parts = name.split(".")
    if table is None or len(parts) < 2 or parts[0] != "aten":
        return bool(FALLBACK.search(name))
    key = f"{parts[1]}.{parts[2] if len(parts) > 2 else 'default'}"
    if key in table:
        return table[key]
    if parts[1].endswith("_") and not parts[1].startswith("_"):  # in place, generated from the out-of-place entry
        return table.get(f"{parts[1][:-1]}.{parts[2] if len(parts) > 2 else 'default'}", False)
    return False
