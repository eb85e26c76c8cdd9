"""Device profiles for the cost model: peak compute, memory bandwidth, host link, memory size.

Note [Device profiles]
Numbers are the vendors' datasheet peaks (dense, i.e. without 2:4 sparsity); ``efficiency`` scales them to
what training kernels reach. It is calibrated once, on V100, to the no-swap baseline of the window-scheduling
paper (arXiv 2010.14109): with 0.74, the per-operator roofline (Note [Per-operator roofline]) over the captured
ResNet-50 batch-64 step (24.3 GFLOP and 0.80 GB moved per image) gives 338 images/s, the paper's V100 figure being 336
(tests/swap/test_cost_model.py checks it; with one roofline per segment instead, 0.71 gave 336). The same fraction is
used for the other devices, an assumption until a measured profile replaces it (``measured``:
the link bandwidths and per-step times ``SwapManager.save_profile`` writes on the GPU itself).
``op_overhead`` (seconds per operator beyond its roofline: launches, the framework) is 0 for the datasheet
profiles, which have nothing measured to set it from; the CPU profile measures it, and also the rates of the
operator classes the roofline misprices there and the first touch of large allocations (``class_rates``,
``attention_flops``, ``fresh_page_bandwidth``: Note [Operator classes] in swap/forecast/pricing.py), which the
datasheet profiles leave unset.

Each operator runs on the peak of its precision and kind (Note [Peaks by precision and kind]). Host links are
per direction: PCIe Gen4 x16 is 32 GB/s nominal and pinned copies reach about 25; Gen5 x16 is 64 nominal, about
55 reached.

- v100-16gb: fp32 15.7 TF, fp16 tensor 125 TF; 900 GB/s HBM2, 16 GB; NVLink 2.0 to an IBM POWER9, 50 GB/s
  each way (the window-scheduling paper's "2x50 GB/s"). Sources: NVIDIA Tesla V100 datasheet; that paper's
  Section 5.
- p100-16gb: fp32 10.6 TF, fp16 21.2 TF; 732 GB/s HBM2, 16 GB; NVLink 1.0 to POWER8, 40 GB/s (TFLMS's
  Minsky). Sources: NVIDIA Tesla P100 datasheet; the TFLMS paper's Section 5.
- a100-40gb / a100-80gb (PCIe): fp32 19.5 TF, TF32 156 TF, bf16 312 TF; 1555 / 1935 GB/s HBM2(e), 40 / 80 GB;
  PCIe Gen4 x16. Source: NVIDIA A100 Tensor Core GPU datasheet.
- h100-sxm: fp32 67 TF, TF32 495 TF, bf16 989 TF; 3350 GB/s HBM3, 80 GB; PCIe Gen5 x16 to the host (NVLink
  joins GPUs, not the CPU). Source: NVIDIA H100 Tensor Core GPU datasheet (SXM5).
- h100-pcie: fp32 51 TF, TF32 378 TF, bf16 756 TF; 2000 GB/s HBM2e, 80 GB; PCIe Gen5 x16. Source: NVIDIA H100
  Tensor Core GPU datasheet (PCIe).
- h200: fp32 67 TF, TF32 495 TF, bf16 989 TF; 4800 GB/s HBM3e (NVIDIA H200 Tensor Core GPU datasheet, SXM);
  memory and host link *measured* on this project's first GPU run (bench/results/gpu/NVIDIA_H200/): torch
  reports 150,109,880,320 bytes; pinned copies of 1 GiB ran at 55.3 GB/s host to device and 55.2 device to host
  (pinned_bandwidth.md; 51.4 + 50.8 = 101 GB/s when both directions run at once, 8 % under two independent
  lanes: ``duplex_bandwidth``).
- l4: fp32 30.3 TF, TF32 60 TF, bf16 121 TF; 300 GB/s GDDR6, 24 GB; PCIe Gen4 x16. Source: NVIDIA L4 datasheet.
- rtx4090-24gb: fp32 82.6 TF, TF32 82.6 TF, bf16 165.2 TF (with fp32 accumulate, what PyTorch uses); 1008
  GB/s GDDR6X, 24 GB; PCIe Gen4 x16. Source: NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A.

``duplex_bandwidth`` is what the host link carries in both directions at once (0: each direction at its
full rate, as the datasheet profiles assume). Only the model-state simulation reads it
(swap/schedule/model_state/sim.py). The PCIe Gen5 profiles take the H200 machine's measured 101 GB/s, the only
measurement of a Gen5 link in both directions we have; the Gen4 and NVLink profiles have none and leave it 0.

Old short names stay as aliases (``v100``, ``p100``, ``h100`` = h100-sxm: the SXM5 part, whose host link is
PCIe Gen5 all the same; ``rtx4090``), so earlier commands and results keep their meaning.

Note [Peaks by precision and kind]
bf16/fp16 operators run on the tensor-core peak (``lowp_flops``). An fp32 operator runs on the fp32 peak unless
PyTorch lets its library use TF32 tensor cores: cuDNN convolutions do by default
(``torch.backends.cudnn.allow_tf32`` is True), cuBLAS matmuls only when asked
(``torch.backends.cuda.matmul.allow_tf32``, or ``torch.set_float32_matmul_precision("high")``). A profile says
which it assumes (``tf32_conv``, ``tf32_matmul``; PyTorch's defaults unless ``with_tf32`` sets them), and such
an operator then runs on ``tf32_flops`` (the datasheets' dense TF32 figures above; a profile without one keeps
the fp32 peak). The kinds are the operators' aten names (``OPERATOR_KINDS``): matmuls (mm, addmm, bmm, baddbmm,
grouped mm) and convolutions (forward and backward). Other operators, attention kernels among them, keep the
peak of their precision. On an H100 SXM the ratio of peak FLOP/s to memory bandwidth is then 295 FLOP/B for bf16,
148 for TF32 and 20 for plain fp32: priced on one ratio, an fp32 matmul would be off by up to 15x against a
memory-bound operator.

Other per-device figures (e.g. the cost of VMM driver calls) belong in tables keyed by these profile names,
or in fields added here with defaults, so every profile keeps constructing without them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from .schedule.budget import refuse_over_memory
from .schedule.model_state import STATE_TENSORS
from .units import size_arg

log = logging.getLogger("swap")
GB = 1e9
OTHER, MATMUL, CONV = 0, 1, 2  # operator kinds (Note [Peaks by precision and kind])
OPERATOR_KINDS = {
    **dict.fromkeys(("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten._grouped_mm"), MATMUL),
    **dict.fromkeys(("aten.convolution", "aten.convolution_backward", "aten.cudnn_convolution",
                     "aten.cudnn_convolution_transpose"), CONV),
}  # fmt: skip


def operator_kind(name: str) -> int:
    """The kind of an operator by its aten name, with or without its overload ("aten.mm.default")."""
    kind = OPERATOR_KINDS.get(name)
    return kind if kind is not None else OPERATOR_KINDS.get(name.rsplit(".", 1)[0], OTHER)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    fp32_flops: float  # FLOP/s
    lowp_flops: float  # FLOP/s for bf16/fp16 (tensor cores)
    mem_bandwidth: float  # bytes/s
    h2d_bandwidth: float  # bytes/s, host to device
    d2h_bandwidth: float  # bytes/s, device to host
    memory: int  # bytes
    efficiency: float = 0.74  # fraction of peak compute and bandwidth that training kernels reach
    tf32_flops: float = 0.0  # FLOP/s on tensor cores in TF32 (0: none; Note [Peaks by precision and kind])
    source: str = ""  # where the figures come from
    op_overhead: float = 0.0  # seconds each operator costs beyond its roofline (launch, framework); 0: unmeasured
    # Measured rates per operator class, where the roofline's two numbers are not enough (Note [Operator
    # classes] in swap/forecast/pricing.py): class -> (FLOP/s, bytes/s), 0 where the class has no such term; and CPU
    # flash attention's FLOP/s by head dim, as (head dim, FLOP/s) pairs. None / (): every operator on the roofline (the
    # datasheet GPU profiles).
    class_rates: Optional[dict[str, tuple[float, float]]] = None
    attention_flops: tuple[tuple[int, float], ...] = ()
    fresh_page_bandwidth: float = 0.0  # bytes/s at which a large allocation's fresh pages fault in; 0: free
    duplex_bandwidth: float = 0.0  # bytes/s over the host link in both directions at once; 0: no limit (Note)
    tf32_conv: bool = True  # fp32 convolutions run in TF32 (PyTorch's default; Note [Peaks by precision and kind])
    tf32_matmul: bool = False  # fp32 matmuls run in TF32 (off by PyTorch's default)

    def peak_flops(self, low_precision: Any = False, kind: Any = OTHER) -> Any:
        """FLOP/s of operators of a precision and a kind (Note [Peaks by precision and kind]); elementwise."""
        tf32 = self.tf32_flops or self.fp32_flops
        conv, matmul = (tf32 if on else self.fp32_flops for on in (self.tf32_conv, self.tf32_matmul))
        fp32 = np.where(np.equal(kind, CONV), conv, np.where(np.equal(kind, MATMUL), matmul, self.fp32_flops))
        return np.where(low_precision, self.lowp_flops, fp32)

    def step_seconds(self, flops: Any, nbytes: Any, low_precision: Any = False, kind: Any = OTHER) -> Any:
        """Roofline: an operator takes the longer of its compute (on the peak of its precision and kind) and its
        memory traffic, plus the per-operator overhead. Scalars give a float; numpy arrays are priced
        elementwise (swap.forecast.pricing)."""
        peak = self.peak_flops(low_precision, kind)
        seconds = np.maximum(np.divide(flops, peak * self.efficiency),
                             np.divide(nbytes, self.mem_bandwidth * self.efficiency)) + self.op_overhead  # fmt: skip
        return seconds if seconds.ndim else float(seconds)


class _Profiles(dict):
    """The profiles by name; an old short name (``ALIASES``) still indexes its profile, without being listed."""

    def __missing__(self, key: str) -> DeviceProfile:
        if key in ALIASES:
            return self[ALIASES[key]]
        raise KeyError(key)


PCIE3, PCIE4, PCIE5 = 12 * GB, 25 * GB, 55 * GB
PCIE5_DUPLEX = 101 * GB  # measured on the H200 machine (Note [Device profiles])
PROFILES = _Profiles({
    "v100-16gb": DeviceProfile(
        "V100-16GB, NVLink 2x50 GB/s to a POWER9", 15.7e12, 125e12, 900 * GB, 50 * GB, 50 * GB, 16 << 30,
        source="NVIDIA Tesla V100 datasheet; the window-scheduling paper (arXiv 2010.14109) Section 5 (IBM POWER9, "
               "NVLink 2.0 to the CPU)",
    ),
    "p100-16gb": DeviceProfile(
        "P100-16GB, NVLink 40 GB/s (TFLMS)", 10.6e12, 21.2e12, 732 * GB, 40 * GB, 40 * GB, 16 << 30,
        source="NVIDIA Tesla P100 datasheet; the TFLMS paper, Section 5 (POWER8 Minsky, NVLink 1.0)",
    ),
    "a100-40gb": DeviceProfile(
        "A100-40GB, PCIe Gen4 x16", 19.5e12, 312e12, 1555 * GB, PCIE4, PCIE4, 40 << 30, tf32_flops=156e12,
        source="NVIDIA A100 Tensor Core GPU datasheet (A100 40GB PCIe)",
    ),
    "a100-80gb": DeviceProfile(
        "A100-80GB, PCIe Gen4 x16", 19.5e12, 312e12, 1935 * GB, PCIE4, PCIE4, 80 << 30, tf32_flops=156e12,
        source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe)",
    ),
    "h100-sxm": DeviceProfile(
        "H100-SXM5-80GB, PCIe Gen5 x16 to the host", 67e12, 989e12, 3350 * GB, PCIE5, PCIE5, 80 << 30,
        tf32_flops=495e12, duplex_bandwidth=PCIE5_DUPLEX,
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM); PCI-SIG Gen5 x16",
    ),
    "h100-pcie": DeviceProfile(
        "H100-PCIe-80GB, PCIe Gen5 x16", 51e12, 756e12, 2000 * GB, PCIE5, PCIE5, 80 << 30, tf32_flops=378e12,
        duplex_bandwidth=PCIE5_DUPLEX, source="NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe); PCI-SIG Gen5 x16",
    ),
    "h200": DeviceProfile(
        "H200-SXM-141GB, PCIe Gen5 x16 to the host (link measured)", 67e12, 989e12, 4800 * GB, 55.3 * GB, 55.2 * GB,
        150_109_880_320, tf32_flops=495e12, duplex_bandwidth=PCIE5_DUPLEX,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); memory and pinned copy bandwidth measured by make gpu "
               "(bench/results/gpu/NVIDIA_H200)",
    ),
    "l4": DeviceProfile(
        "L4-24GB, PCIe Gen4 x16", 30.3e12, 121e12, 300 * GB, PCIE4, PCIE4, 24 << 30, tf32_flops=60e12,
        source="NVIDIA L4 Tensor Core GPU datasheet",
    ),
    "rtx4090-24gb": DeviceProfile(
        "GeForce RTX 4090-24GB, PCIe Gen4 x16", 82.6e12, 165.2e12, 1008 * GB, PCIE4, PCIE4, 24 << 30,
        tf32_flops=82.6e12, source="NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A (RTX 4090)",
    ),
    "rtx2080ti-11gb": DeviceProfile(
        "GeForce RTX 2080 Ti-11GB, PCIe Gen3 x16", 13.45e12, 53.8e12, 616 * GB, PCIE3, PCIE3, 11 << 30,
        source="NVIDIA Turing GPU architecture whitepaper, appendix A, table 9 (GeForce RTX 2080 Ti Founders "
               "Edition: 4352 CUDA cores at 1545 MHz boost, FP16 tensor FLOPS with FP32 accumulate, 616 GB/s "
               "GDDR6, 11 GB); PCI-SIG Gen3 x16; the device of SFT (segmented fused-tiled execution, CC'22)",
    ),
})  # fmt: skip
ALIASES = {"v100": "v100-16gb", "p100": "p100-16gb", "h100": "h100-sxm", "rtx4090": "rtx4090-24gb"}


def profile(name: str) -> DeviceProfile:
    """The named profile (or an alias of one)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    try:
        return PROFILES[key]
    except KeyError:
        names = ", ".join(list(PROFILES) + list(ALIASES))
        raise ValueError(f"unknown device profile {name!r}: choose one of {names}") from None


TF32_SETTINGS = ("auto", "on", "off")


def with_tf32(dev: DeviceProfile, setting: Union[str, bool, None] = "auto") -> DeviceProfile:
    """``dev`` with its fp32 operators priced as PyTorch will run them (Note [Peaks by precision and kind]):
    "auto" (or None) reads PyTorch's flags now (``torch.backends.cudnn.allow_tf32`` for convolutions,
    ``torch.backends.cuda.matmul.allow_tf32`` for matmuls); "on" (True) both in TF32; "off" (False) neither."""
    if setting is None or setting == "auto":
        import torch

        cudnn, cublas = torch.backends.cudnn, torch.backends.cuda.matmul
        conv = _tf32_allowed(lambda: cudnn.allow_tf32, lambda: cudnn.conv.fp32_precision, lambda: cudnn.fp32_precision,
                             lambda: torch.backends.fp32_precision)  # fmt: skip
        matmul = _tf32_allowed(lambda: cublas.allow_tf32, lambda: cublas.fp32_precision,
                               lambda: torch.backends.fp32_precision)  # fmt: skip
    elif setting in ("on", True) or setting in ("off", False):
        conv = matmul = setting in ("on", True)
    else:
        raise ValueError(f"tf32={setting!r}: choose one of {', '.join(TF32_SETTINGS)} (or True / False)")
    return dataclasses.replace(dev, tf32_conv=conv, tf32_matmul=matmul)


def _tf32_allowed(legacy: Callable[[], Any], *precisions: Callable[[], str]) -> bool:
    """PyTorch's TF32 flag: the legacy ``allow_tf32``; once its ``fp32_precision`` settings have set one, PyTorch
    refuses that read, and the innermost setting that is not "none" (inherit) says ("tf32" or "ieee")."""
    try:
        return bool(legacy())
    except RuntimeError:
        return next((p for p in (f() for f in precisions) if p != "none"), "ieee") == "tf32"


def cuda_profile(device_name: str) -> DeviceProfile:
    """The datasheet profile of a CUDA device by the name torch gives it ("NVIDIA H100 80GB HBM3"); H100 SXM's
    for a device none matches (what the runtime prices operators with: only their relative costs count)."""
    name = device_name.lower().replace(" ", "").replace("-", "")
    for key, words in (("h200", ("h200",)), ("h100-pcie", ("h100pcie",)), ("h100-sxm", ("h100",)),
                       ("a100-40gb", ("a100", "40gb")), ("a100-80gb", ("a100",)), ("l4", ("l4",)),
                       ("rtx4090-24gb", ("4090",)), ("rtx2080ti-11gb", ("2080ti",)), ("v100-16gb", ("v100",)),
                       ("p100-16gb", ("p100",))):  # fmt: skip
        if all(w in name for w in words):
            return PROFILES[key]
    return PROFILES["h100-sxm"]


def refuse_budget_above(budget: int, dev: DeviceProfile, label: str = "",
                        spell: Callable[[str, str], str] = lambda option, v: f"{option}={v!r}") -> None:  # fmt: skip
    """ValueError when ``budget`` is more than the device's memory (Note [A budget above the device's memory]
    in swap/schedule/budget.py), naming the largest budget that fits and the profiles that have that much memory.
    ``label``: the device as the user named it; ``spell(option, value)`` writes an option as the caller takes
    it ("budget='16GiB'", "--budget 16GiB")."""
    instead = f"pass {spell('budget', size_arg(dev.memory))} or less"
    larger = [name for name, p in PROFILES.items() if p.memory >= budget]
    if larger:
        also = f"; also {', '.join(larger[1:])}" if larger[1:] else ""
        instead += f", or a device with that much memory ({spell('device', larger[0])}{also})"
    refuse_over_memory(budget, dev.memory, f"the memory of {label or dev.name}", instead)


@dataclass(frozen=True)
class Measured:
    """What a measured profile (``SwapManager.save_profile``) says about the device: link bandwidths, and the
    compute seconds of the iteration it profiled (at ``batch``, when the file records it)."""

    device: str
    h2d_bandwidth: Optional[float]
    d2h_bandwidth: Optional[float]
    compute_seconds: float
    saved_bytes: int  # bytes of the swappable variables of the profiled iteration
    batch: Optional[int]
    path: str


def read_measured(path: Union[str, Path]) -> Measured:
    """Reads a file written by ``SwapManager.save_profile``."""
    from .schedule.sequence import Sequence

    seq, meta = Sequence.load(path)
    return Measured(
        device=str(meta.get("device", "measured")),
        h2d_bandwidth=meta.get("h2d_bandwidth"),
        d2h_bandwidth=meta.get("d2h_bandwidth"),
        compute_seconds=float(sum(seq.compute)),
        saved_bytes=int(sum(s for s, ok in zip(seq.sizes, seq.swappable) if ok)),
        batch=meta.get("batch"),
        path=str(path),
    )


def with_measured(base: DeviceProfile, m: Measured, roofline_seconds: Optional[float] = None) -> DeviceProfile:
    """``base`` with the measured link bandwidths, and with ``efficiency`` set so that the roofline gives the
    measured compute time (``roofline_seconds``: the roofline's time for the same iteration at efficiency 1)."""
    changes: dict[str, Any] = {"name": f"{base.name}, measured ({m.device}, {Path(m.path).name})"}
    if m.h2d_bandwidth:
        changes["h2d_bandwidth"] = float(m.h2d_bandwidth)
    if m.d2h_bandwidth:
        changes["d2h_bandwidth"] = float(m.d2h_bandwidth)
    if roofline_seconds and m.compute_seconds > 0:
        changes["efficiency"] = roofline_seconds / m.compute_seconds
    return dataclasses.replace(base, **changes)


# -- interconnects between ranks ----------------------------------------------------------------------------
@dataclass(frozen=True)
class InterconnectProfile:
    """What the collectives of data-parallel training (FSDP2's all-gather and reduce-scatter) run on, per GPU.

    Note [Interconnect profiles]
    A ring all-gather or reduce-scatter of ``n`` bytes (the unsharded size) over ``w`` ranks moves
    ``n * (w - 1) / w`` bytes through each GPU's link, so its time is that over the *bus bandwidth* (the figure
    nccl-tests reports as busbw, which NVIDIA quotes as the expectation), plus a fixed ``latency`` per call.
    - nvlink4: H100 SXM in an 8-GPU NVSwitch node (DGX/HGX H100). NVLink 4 is 900 GB/s bidirectional per GPU
      (450 GB/s each way; datasheet); all-gather and reduce-scatter reach a busbw of 360 GB/s, "exactly what we'd
      expect on H100" (an NCCL maintainer, NVIDIA/nccl-tests issue 326, 8 x H100, 128 MB to 16 GB messages).
      Latency: 10 us, assumed (a 70B block's all-gather moves 1.7 GB: the fixed term is far below 1%).
    - ib-ndr400: across nodes, one ConnectX-7 NDR 400 Gb/s NIC per GPU (DGX H100): "for NDR @ 400Gbps you should
      see 46-48GB/s per NIC" (an NCCL maintainer, NVIDIA/nccl-tests issue 290); the lower figure is taken. Latency:
      47 us, the small-message time of a 2-node 16-GPU all-reduce over NDR (NVIDIA/nccl issue 1244's table).
    """

    name: str
    bus_bandwidth: float  # bytes/s per GPU for a large all-gather / reduce-scatter (nccl-tests busbw)
    latency: float = 0.0  # seconds per collective call
    source: str = ""

    def collective_seconds(self, nbytes: float, world_size: int) -> float:
        """Seconds of one ring all-gather or reduce-scatter whose unsharded size is ``nbytes``."""
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + nbytes * (world_size - 1) / world_size / self.bus_bandwidth


INTERCONNECTS = {
    "nvlink4": InterconnectProfile(
        "NVLink 4 (H100 SXM, 8-GPU NVSwitch node)", 360 * GB, 10e-6,
        source="NVIDIA H100 datasheet (900 GB/s bidirectional); NVIDIA/nccl-tests issue 326 (busbw 360 GB/s)",
    ),
    "ib-ndr400": InterconnectProfile(
        "InfiniBand NDR 400 Gb/s, one NIC per GPU", 46 * GB, 47e-6,
        source="NVIDIA/nccl-tests issue 290 (46-48 GB/s per NDR NIC); NVIDIA/nccl issue 1244 (latency)",
    ),
}  # fmt: skip


def interconnect(name: str) -> InterconnectProfile:
    """The named interconnect profile (``INTERCONNECTS``)."""
    try:
        return INTERCONNECTS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown interconnect {name!r}: choose one of {', '.join(INTERCONNECTS)}") from None


# Note [Host profiles]
# What the host brings to training with model state offloaded (swap/schedule/model_state/): DRAM bandwidth,
# the rate at which it runs the optimizer's step, how much memory it has and may pin, and, where it differs
# from the device profile's, the link. The optimizer's rate is bytes per second of DRAM traffic: a host step
# is memory-bound (AdamW on fp32 masters moves about 28 bytes a parameter for about a dozen FLOPs), so its
# seconds are the bytes it moves (``host_step_bytes``) over that rate, whatever the dtypes.
#
# - desktop-ddr5-2ch: two channels of DDR5 holding 192 GB, which takes four 48 GB DIMMs: two (dual-rank) DIMMs a
#   channel, where desktop memory controllers run far below their one-DIMM-a-channel rate. DDR5-4000: what
#   desktop boards list for two dual-rank DIMMs a channel ("2DPC 2R Max speed up to 4000+", an AM5 board's
#   specification; Intel's 13th/14th-generation Core: DDR5-4000 at 2DPC 2R), so 4000 MT/s x 8 bytes x 2 channels
#   = 64 GB/s peak (two DIMMs at DDR5-5600, 89.6 GB/s, hold 96 GB: too little for an 8 B full fine-tune).
#   Sustained: 75% of the wire rate, the share STREAM reaches in TI's measurements (74-78%, SPRAD45A table 3-2),
#   48 GB/s. A single-pass AdamW kernel at that rate (``KERNEL_SLOWDOWN``: others slower): CPU AdamW stays
#   DRAM-bound once enough cores run it (prime-rl PR #3248: "still DRAM-bandwidth-bound" after thread budgeting).
#   192 GB is the most AM5 and LGA1700 desktop boards take (Intel ARK, Core i9-13900K: max memory 192 GB).
#   Pinnable: all but 16 GiB (an assumption: the OS, the framework and the data loader's pages).
# - server-ddr5-8ch: one socket of eight DDR5 channels (4th-generation Xeon), 16 x 64 GiB = 1 TiB at two
#   DIMMs a channel, where the data rate drops from 4800 to 4400 MT/s (Dell, "Memory Bandwidth for Next-Gen
#   PowerEdge Servers ... Sapphire Rapids", 2023): 8 x 4400 x 8 = 281.6 GB/s peak, 211.2 sustained (75%, as
#   above), AdamW at that rate. Pinnable: all but 32 GiB (assumption, as above).
# - a measured profile (``read_host_profile``): what bench/host_profile.py measures on the machine it runs on
#   (copy bandwidth, and the optimizers' rates with PyTorch's own CPU kernels and threads), written as JSON.
#
# The optimizer's rate depends on its kernel (``KERNELS``): the built-ins' rates are a single-pass kernel's
# (torch's ``fused=True`` CPU kernel, DeepSpeed's CPU-Adam); torch's ``foreach`` kernel and its per-tensor loop
# (what torch runs on CPU tensors by default) make several passes over the state with temporaries between them,
# and are slower by ``KERNEL_SLOWDOWN``: the ratios bench/host_profile.py measured with torch's own kernels
# (bench/results/host_profile.json: AdamW fused 4.79 GB/s, foreach 1.28, for-loop 0.94, so 3.7x and 5.1x; SGD
# with momentum 1.8x and 1.7x), in line with DeepSpeed's "CPU-Adam is 5X-7X faster than the standard PyTorch
# implementation" (deepspeed.ai ZeRO-Offload tutorial). Counting bytes alone (the loop's eight elementwise passes
# move about 80 bytes an fp32 parameter, the fused kernel 28) gives 2.9x, a floor. A measured profile carries its
# own rate per kernel where bench/host_profile.py measured one.
#
# Link figures are None on the built-ins: the device profile's (its PCIe generation) apply. A measured
# profile of a machine with a GPU may carry its own.
# the master and its state tensors (Note [Optimizer state by optimizer]), each read and written once a step
OPTIMIZER_PASSES = {name: (1 + n, 1 + n) for name, n in STATE_TENSORS.items()}  # tensors read, written
KERNELS = ("fused", "foreach", "for-loop")  # the host optimizer's kernel (Note [Host profiles])
KERNEL_SLOWDOWN = {  # the fused kernel's rate over the others' (Note [Host profiles]): bench/results/host_profile.json
    "adamw": {"fused": 1.0, "foreach": 4.79 / 1.28, "for-loop": 4.79 / 0.94},
    "sgd": {"fused": 1.0, "foreach": 7.63 / 4.30, "for-loop": 7.63 / 4.58},
}


def host_step_bytes(optimizer: str, numel: int, master: int, grad: int, copy: int = 0) -> int:
    """DRAM bytes a host step of ``numel`` parameters moves (Note [Host profiles]): the master and the
    optimizer's state read and written (``OPTIMIZER_PASSES``, ``master`` bytes each per parameter), the
    gradient read (``grad`` bytes), and the compute-dtype copy written (``copy`` bytes; 0 when the master is
    what the device computes with)."""
    if optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_PASSES)}")
    reads, writes = OPTIMIZER_PASSES[optimizer]
    return numel * ((reads + writes) * master + grad + copy)


@dataclass(frozen=True)
class HostProfile:
    """The host side of training with offloaded model state (Note [Host profiles]).

    Attributes:
        name: what it is.
        dram_bandwidth: sustained DRAM bytes/s (reads plus writes), shared by the host step and the link's DMA.
        optimizer_rates: optimizer name (``OPTIMIZER_PASSES``) -> bytes/s of DRAM traffic its host step moves.
        memory: bytes of host memory.
        pinnable: bytes of it that may be page-locked.
        h2d_bandwidth, d2h_bandwidth, duplex_bandwidth: the link, when it differs from the device profile's
            (None: the device profile's).
        source: where the figures come from.
    """

    name: str
    dram_bandwidth: float
    optimizer_rates: dict[str, float]
    memory: int
    pinnable: int
    h2d_bandwidth: Optional[float] = None
    d2h_bandwidth: Optional[float] = None
    duplex_bandwidth: Optional[float] = None
    source: str = ""

    def optimizer_rate(self, optimizer: str, kernel: str = "fused") -> float:
        """Bytes/s of DRAM traffic of ``optimizer``'s host step with ``kernel`` (``KERNELS``; Note [Host
        profiles]): the profile's own rate for that kernel (key ``"adamw:for-loop"``) where it has one, else its
        fastest rate over ``KERNEL_SLOWDOWN``. Adam's for AdamW and the other way round when only one was
        measured; SGD's at the DRAM bandwidth when unmeasured."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown host optimizer kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
        rates = self.optimizer_rates
        twin = {"adamw": "adam", "adam": "adamw"}.get(optimizer, "")
        own = rates.get(f"{optimizer}:{kernel}") or rates.get(f"{twin}:{kernel}")
        if own:
            return float(own)
        rate = rates.get(optimizer) or rates.get(twin) or (self.dram_bandwidth if optimizer.startswith("sgd") else 0)
        if not rate:
            raise ValueError(f"host profile {self.name!r} has no rate for {optimizer!r}: it has {', '.join(rates)}")
        slowdown = KERNEL_SLOWDOWN["sgd" if optimizer.startswith("sgd") else "adamw"][kernel]
        return float(rate) / slowdown

    def step_seconds(self, optimizer: str, numel: int, master: int, grad: int, copy: int = 0,
                     kernel: str = "fused") -> float:  # fmt: skip
        """Seconds of a host step of ``numel`` parameters (``host_step_bytes`` over the kernel's rate)."""
        return host_step_bytes(optimizer, numel, master, grad, copy) / self.optimizer_rate(optimizer, kernel)


def _sustained(peak: float) -> float:
    return 0.75 * peak  # Note [Host profiles]: STREAM's share of the wire rate


HOST_PROFILES = {
    "desktop-ddr5-2ch": HostProfile(
        "desktop, 2 channels DDR5-4000 (4 x 48 GB, 2 dual-rank DIMMs a channel), 192 GB", _sustained(64 * GB),
        {"adamw": _sustained(64 * GB)}, 192 * 10**9, 192 * 10**9 - (16 << 30),
        source="2 DIMMs a channel, dual rank: DDR5-4000 (desktop boards' 2DPC 2R rating; Intel 13th/14th-gen Core), "
               "4000 MT/s x 8 B x 2 channels = 64 GB/s; 75% sustained (TI SPRAD45A, STREAM 74-78% of the wire rate); "
               "single-pass AdamW DRAM-bound (prime-rl PR #3248); Intel ARK i9-13900K (192 GB)",
    ),
    "server-ddr5-8ch": HostProfile(
        "server, 8 channels DDR5-4400 (2 DIMMs a channel), 1 TiB", _sustained(281.6 * GB),
        {"adamw": _sustained(281.6 * GB)}, 1 << 40, (1 << 40) - (32 << 30),
        source="Dell PowerEdge Sapphire Rapids memory note (8 channels, DDR5-4800 at 1 DPC, 4400 at 2 DPC): 8 x "
               "4400 MT/s x 8 B = 281.6 GB/s; 75% sustained (TI SPRAD45A); AdamW DRAM-bound (prime-rl PR #3248)",
    ),
}


def default_host(dev: DeviceProfile) -> str:
    """The host profile a device is planned with when none is named (``swap.plan`` without ``host``, where model
    state resident on the device fits nothing): a server's for a device of more than 48 GiB (the data-centre
    parts: A100, H100, H200), a desktop's for the rest (the GeForce cards, 24 GiB at most)."""
    return "server-ddr5-8ch" if dev.memory > 48 << 30 else "desktop-ddr5-2ch"


def read_host_profile(path: Union[str, Path]) -> HostProfile:
    """A host profile written by bench/host_profile.py (its ``profile`` object)."""
    import json

    data = json.loads(Path(path).read_text())
    fields = dict(data.get("profile", data))
    variants = data.get("optimizer_variants", {})  # each kernel's measured rate (Note [Host profiles])
    if variants and isinstance(fields.get("optimizer_rates"), dict):
        fields["optimizer_rates"] = {**fields["optimizer_rates"], **{f"{opt}:{kernel}": rate for opt, kernels in
                                     variants.items() for kernel, rate in kernels.items() if kernel in KERNELS}}
    try:
        return HostProfile(**fields)
    except TypeError as e:
        raise ValueError(f"{path} is not a host profile written by bench/host_profile.py ({e})") from None


def host_profile(name: Union[str, Path, HostProfile]) -> HostProfile:
    """A built-in host profile by name (``HOST_PROFILES``), or one read from a file bench/host_profile.py wrote."""
    if isinstance(name, HostProfile):
        return name
    key = str(name).lower()
    if key in HOST_PROFILES:
        return HOST_PROFILES[key]
    if str(name).endswith(".json") and Path(name).exists():
        return read_host_profile(name)
    raise ValueError(f"unknown host profile {name!r}: choose one of {', '.join(HOST_PROFILES)}, or give the path of "
                     "a profile bench/host_profile.py wrote (bench/results/host_profile.json)")  # fmt: skip
