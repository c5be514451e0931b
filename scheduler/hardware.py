"""GPU catalog: the few hardware facts the cost model needs, each with its source.

Units: throughput in FLOP/s, memory in bytes, bandwidths in bytes per second *per direction*.
Vendors quote NVLink and PCIe as bidirectional totals ("900 GB/s"); we store half of that,
because a collective or a copy is limited by what one GPU can send while it receives.
"GB" in a datasheet is 10^9 bytes for bandwidth; for HBM capacity we follow the datasheet's
number (80 GB -> 80 * 10^9 bytes), which is what the driver reports within a percent or two.

An agent that runs on a GPU not listed here reports a custom spec (`GpuSpec.from_dict`);
the snapshot carries it, and everything downstream treats it like a catalog entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from scheduler._lazy import cached_field_hash, state_without_hash

Confidence = Literal["high", "medium", "low"]
_CONFIDENCES: tuple[Confidence, ...] = ("high", "medium", "low")

GB = 10**9
TFLOPS = 10**12


@dataclass(frozen=True)
class GpuSpec:
    """What one accelerator can do, as its vendor states it (peak, not achieved)."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    name: str  # catalog key, e.g. "H100-SXM"
    bf16_flops: float  # dense BF16/FP16 tensor-core peak, FLOP/s (no 2:4 sparsity)
    mem_bytes: int  # device memory capacity
    hbm_bytes_per_s: float  # peak device-memory bandwidth
    intra_link_bytes_per_s: float  # GPU-to-GPU inside one NVLink/NVSwitch/HCCS domain, per direction; 0 = none
    host_link_bytes_per_s: float  # host link (PCIe) per direction; also the GPU-GPU path without NVLink
    confidence: Confidence = "high"  # how far the public figures agree
    source: str = ""  # where the figures come from
    note: str = ""  # caveats worth showing an operator

    def __post_init__(self) -> None:
        _positive("name", len(self.name))
        for field in ("bf16_flops", "mem_bytes", "hbm_bytes_per_s", "host_link_bytes_per_s"):
            _positive(field, getattr(self, field))
        if self.intra_link_bytes_per_s < 0:
            raise ValueError(f"intra_link_bytes_per_s: must be >= 0, got {self.intra_link_bytes_per_s}")
        if self.confidence not in _CONFIDENCES:
            raise ValueError(f"confidence: must be one of {_CONFIDENCES}, got {self.confidence!r}")

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "bf16_flops": self.bf16_flops,
            "mem_bytes": self.mem_bytes,
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "intra_link_bytes_per_s": self.intra_link_bytes_per_s,
            "host_link_bytes_per_s": self.host_link_bytes_per_s,
            "confidence": self.confidence,
            "source": self.source,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object], path: str = "spec") -> GpuSpec:
        """A custom spec as an agent reports it; errors name `path.field`."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object, got {type(d).__name__}")
        required = ("name", "bf16_flops", "mem_bytes", "hbm_bytes_per_s", "host_link_bytes_per_s")
        optional = ("intra_link_bytes_per_s", "confidence", "source", "note")
        unknown = sorted(set(d) - set(required) - set(optional))
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key (allowed: {', '.join(required + optional)})")
        for key in required:
            if key not in d:
                raise ValueError(f"{path}.{key}: required")
        name = d["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{path}.name: must be a non-empty string")
        confidence = d.get("confidence", "medium")
        if confidence not in _CONFIDENCES:
            raise ValueError(f"{path}.confidence: must be one of {_CONFIDENCES}, got {confidence!r}")
        try:
            return cls(
                name=name,
                bf16_flops=_num(d, "bf16_flops", path),
                mem_bytes=int(_num(d, "mem_bytes", path)),
                hbm_bytes_per_s=_num(d, "hbm_bytes_per_s", path),
                intra_link_bytes_per_s=_num(d, "intra_link_bytes_per_s", path, default=0.0),
                host_link_bytes_per_s=_num(d, "host_link_bytes_per_s", path),
                confidence=confidence,
                source=str(d.get("source", "")),
                note=str(d.get("note", "")),
            )
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(path) else f"{path}.{msg}") from None


def _num(d: Mapping[str, object], key: str, path: str, default: float | None = None) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{path}.{key}: must be a number, got {value!r}")
    return float(value)


def _positive(field: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{field}: must be > 0, got {value!r}")


# The catalog. Comments carry the source of every figure.
_CATALOG: tuple[GpuSpec, ...] = (
    # NVIDIA H200 SXM datasheet, https://www.nvidia.com/en-us/data-center/h200/ :
    # BF16 1,979 TFLOPS with sparsity -> 989 dense; 141 GB HBM3e at 4.8 TB/s;
    # NVLink 900 GB/s (bidirectional); PCIe Gen5 128 GB/s (bidirectional).
    GpuSpec(
        name="H200",
        bf16_flops=989 * TFLOPS,
        mem_bytes=141 * GB,
        hbm_bytes_per_s=4800 * GB,
        intra_link_bytes_per_s=450 * GB,
        host_link_bytes_per_s=64 * GB,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    # NVIDIA H100 SXM5 datasheet, https://www.nvidia.com/en-us/data-center/h100/ :
    # BF16 1,979 TFLOPS with sparsity -> 989 dense; 80 GB HBM3 at 3.35 TB/s;
    # NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    GpuSpec(
        name="H100-SXM",
        bf16_flops=989 * TFLOPS,
        mem_bytes=80 * GB,
        hbm_bytes_per_s=3350 * GB,
        intra_link_bytes_per_s=450 * GB,
        host_link_bytes_per_s=64 * GB,
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    # NVIDIA A100 datasheet (SXM columns),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf :
    # BF16 312 TFLOPS dense; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s; PCIe Gen4 64 GB/s.
    GpuSpec(
        name="A100-80G",
        bf16_flops=312 * TFLOPS,
        mem_bytes=80 * GB,
        hbm_bytes_per_s=2039 * GB,
        intra_link_bytes_per_s=300 * GB,
        host_link_bytes_per_s=32 * GB,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    # Same datasheet, A100 40GB SXM: BF16 312 TFLOPS; 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s.
    GpuSpec(
        name="A100-40G",
        bf16_flops=312 * TFLOPS,
        mem_bytes=40 * GB,
        hbm_bytes_per_s=1555 * GB,
        intra_link_bytes_per_s=300 * GB,
        host_link_bytes_per_s=32 * GB,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    # NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/ :
    # BF16 362.05 TFLOPS dense (733 with sparsity); 48 GB GDDR6 at 864 GB/s; no NVLink;
    # PCIe Gen4 x16 64 GB/s (bidirectional).
    GpuSpec(
        name="L40S",
        bf16_flops=362 * TFLOPS,
        mem_bytes=48 * GB,
        hbm_bytes_per_s=864 * GB,
        intra_link_bytes_per_s=0.0,
        host_link_bytes_per_s=32 * GB,
        source="https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    # A10G is AWS's variant of the A10 (GA102); AWS states 24 GB per GPU
    # (https://aws.amazon.com/ec2/instance-types/g5/) and no compute figures. Bandwidth and
    # tensor throughput below are the A10 datasheet's (https://www.nvidia.com/en-us/data-center/products/a10-gpu/ :
    # BF16 125 TFLOPS dense, 600 GB/s GDDR6, PCIe Gen4 64 GB/s); third-party A10G figures differ.
    GpuSpec(
        name="A10G",
        bf16_flops=125 * TFLOPS,
        mem_bytes=24 * GB,
        hbm_bytes_per_s=600 * GB,
        intra_link_bytes_per_s=0.0,
        host_link_bytes_per_s=32 * GB,
        confidence="medium",
        source="https://aws.amazon.com/ec2/instance-types/g5/ ; https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
        note="AWS publishes no A10G compute figures; A10 datasheet values used",
    ),
    # Huawei Ascend 910B: public figures conflict between variants (910B1..B4) and sources:
    # FP16 ~280-376 TFLOPS, 64 GB HBM2e, ~1.6 TB/s, HCCS 392 GB/s between the 8 NPUs of a server
    # (Atlas 800T A2, https://e.huawei.com/en/products/computing/ascend/atlas-800t-a2). We take
    # 313 TFLOPS (most cited, 910B3), 1.6 TB/s, HCCS 392 GB/s bidirectional, PCIe Gen5 x16.
    GpuSpec(
        name="Ascend-910B",
        bf16_flops=313 * TFLOPS,
        mem_bytes=64 * GB,
        hbm_bytes_per_s=1600 * GB,
        intra_link_bytes_per_s=196 * GB,
        host_link_bytes_per_s=64 * GB,
        confidence="low",
        source="https://e.huawei.com/en/products/computing/ascend/atlas-800t-a2",
        note="public figures conflict (FP16 280-376 TFLOPS, HBM 1.2-1.8 TB/s); estimates are rough",
    ),
)

CATALOG: Mapping[str, GpuSpec] = {spec.name: spec for spec in _CATALOG}

# Names NVML and vendors use for the same parts, folded to the catalog key (lower case).
_ALIASES: Mapping[str, str] = {
    "nvidia h200": "H200",
    "h200-sxm": "H200",
    "nvidia h100 80gb hbm3": "H100-SXM",
    "h100": "H100-SXM",
    "nvidia a100-sxm4-80gb": "A100-80G",
    "a100": "A100-80G",
    "nvidia a100-sxm4-40gb": "A100-40G",
    "nvidia l40s": "L40S",
    "nvidia a10g": "A10G",
}


def known_gpus() -> tuple[str, ...]:
    """The catalog's names, in catalog order."""
    return tuple(CATALOG)


def resolve_gpu_name(name: str) -> str:
    """The catalog key for `name` (exact, case-insensitive, or a known NVML alias).

    Raises ValueError listing the known names when nothing matches.
    """
    if name in CATALOG:
        return name
    folded = name.strip().lower()
    for key in CATALOG:
        if key.lower() == folded:
            return key
    if folded in _ALIASES:
        return _ALIASES[folded]
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(CATALOG)} (or report a custom spec)")


def gpu_spec(name: str, custom: Mapping[str, GpuSpec] | None = None) -> GpuSpec:
    """The spec for `name`: a custom spec of that exact name first, then the catalog."""
    if custom and name in custom:
        return custom[name]
    return CATALOG[resolve_gpu_name(name)]
