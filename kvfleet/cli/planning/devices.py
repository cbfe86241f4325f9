"""The devices ``kvfleet plan`` knows: memory, memory bandwidth and dense 16-bit tensor FLOPs — the
three numbers a roofline needs. Pure: the CPU's figures are measured by ``kvfleet.cli.planning.cpu_device.measured_cpu``.

Figures are the vendors' datasheets (SXM parts; dense, not the 2:4-sparse numbers), memory as
``nvidia-smi`` reports it (MiB), so that a plan for an H200 matches what a node sees on one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    memory_bytes: int
    bandwidth: float          # bytes/s
    flops: float              # dense bf16/fp16 tensor FLOP/s
    runtime_overhead: int     # bytes no allocation can use: CUDA context, cuBLAS workspaces

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth <= 0 or self.flops <= 0 or self.runtime_overhead < 0:
            raise ValueError(f"device {self.name}: memory, bandwidth and FLOPs must be positive")

    def with_memory(self, memory_bytes: int) -> "Device":
        return replace(self, name=f"{self.name} ({memory_bytes:,} B)", memory_bytes=memory_bytes)


CUDA_OVERHEAD = 1 << 30

DEVICES: dict[str, Device] = {
    # A100 SXM4 80GB: 81920 MiB HBM2e, 2.039 TB/s, 312 TFLOP/s bf16
    "a100-80g": Device("A100-80G", 81920 * MIB, 2.039e12, 312e12, CUDA_OVERHEAD),
    # H100 SXM5 80GB: 81559 MiB HBM3, 3.35 TB/s, 989 TFLOP/s bf16
    "h100-80g": Device("H100-80G", 81559 * MIB, 3.35e12, 989e12, CUDA_OVERHEAD),
    # H200 SXM 141GB: 143771 MiB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16
    "h200": Device("H200", 143771 * MIB, 4.8e12, 989e12, CUDA_OVERHEAD),
    # L40S 48GB: 46068 MiB GDDR6, 864 GB/s, 362 TFLOP/s bf16
    "l40s": Device("L40S", 46068 * MIB, 864e9, 362e12, CUDA_OVERHEAD),
}
CPU = "cpu"  # measured where the plan runs: see kvfleet.cli.planning.cpu_device.measured_cpu
KNOWN = sorted([*DEVICES, CPU])


def device_named(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(KNOWN)}")
    return DEVICES[name]


# The guide's sizing table, by target generated tokens/s: under 2,000; 2,000 to 5,000; above.
def guide_verdict(tokens_per_s: float) -> str:
    if tokens_per_s < 2000:
        return "1 x A100-80G"
    if tokens_per_s <= 5000:
        return "2 x A100-80G with NVLink"
    return "H100s with InfiniBand (no count given)"
