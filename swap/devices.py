"""Device profiles for the cost model: peak compute, memory bandwidth, host link, memory size.

Note [Device profiles]
Numbers are the vendors' datasheet peaks; ``efficiency`` scales them to what training kernels reach. It is
calibrated once, on V100, to seed 001's own no-swap baseline: with 0.71, the roofline over the captured
ResNet-50 batch-64 step (24.3 GFLOP and 0.80 GB moved per image) gives 336 images/s, the paper's V100
figure (tests/swap/test_cost_model.py checks it). The same fraction is used for the other devices, an
assumption until a measured profile (per-step times from a GPU run) replaces it.

- V100-16GB (SXM2): 15.7 TFLOP/s fp32, 125 tensor (fp16/bf16-class), 900 GB/s HBM2, 16 GB. Host link:
  seed 001's IBM POWER9 with NVLink 2.0 to the CPU, "2x50 GB/s" (50 GB/s each way). Sources: NVIDIA Tesla
  V100 datasheet; seed 001 Section 5.
- P100 (SXM2, NVLink): 10.6 TFLOP/s fp32, 21.2 fp16, 732 GB/s HBM2, 16 GB; NVLink 1.0 to POWER8 at 40 GB/s
  each way (TFLMS's Minsky systems). Sources: NVIDIA Tesla P100 datasheet; seed 004 Section 5.
- H100 (SXM5) with PCIe Gen5 x16 to the host: 67 TFLOP/s fp32, 495 TF32 and 989 bf16 dense tensor,
  3.35 TB/s HBM3, 80 GB; PCIe Gen5 x16 64 GB/s each way nominal, 55 GB/s used (what pinned copies reach).
  Sources: NVIDIA H100 datasheet; PCI-SIG Gen5 x16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    fp32_flops: float  # FLOP/s
    lowp_flops: float  # FLOP/s for bf16/fp16 (tensor cores)
    mem_bandwidth: float  # bytes/s
    h2d_bandwidth: float  # bytes/s, host to device
    d2h_bandwidth: float  # bytes/s, device to host
    memory: int  # bytes
    efficiency: float = 0.71  # fraction of peak compute and bandwidth that training kernels reach

    def step_seconds(self, flops: float, nbytes: float, low_precision: bool = False) -> float:
        """Roofline: an operator takes the longer of its compute and its memory traffic."""
        peak = self.lowp_flops if low_precision else self.fp32_flops
        return max(flops / (peak * self.efficiency), nbytes / (self.mem_bandwidth * self.efficiency))


GB = 1e9
PROFILES = {
    "v100": DeviceProfile(
        "V100-16GB, NVLink 2x50 GB/s (seed 001)", 15.7e12, 125e12, 900 * GB, 50 * GB, 50 * GB, 16 << 30
    ),
    "p100": DeviceProfile("P100-16GB, NVLink 40 GB/s (TFLMS)", 10.6e12, 21.2e12, 732 * GB, 40 * GB, 40 * GB, 16 << 30),
    "h100": DeviceProfile("H100-80GB, PCIe Gen5 x16", 67e12, 989e12, 3350 * GB, 55 * GB, 55 * GB, 80 << 30),
}


def profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}: choose one of {', '.join(PROFILES)}") from None
