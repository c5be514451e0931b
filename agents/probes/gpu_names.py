"""From the product name NVML reports to the name of a GPU in our catalog (scheduler/hardware.py).

NVML's `nvmlDeviceGetName` returns the marketing name the driver holds for the board, e.g.
"NVIDIA H100 80GB HBM3" for the SXM5 H100 (`nvidia-smi -L` prints the same string). Drivers
before R470 left out the "NVIDIA " prefix ("A100-SXM4-40GB"), so we match without it.

Only exact names map: a PCIe or NVL variant of a catalogued GPU ("NVIDIA H100 PCIe",
"NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe") has other clocks, power and links, so it is
reported as a custom spec rather than silently taking the SXM figures.
"""

from __future__ import annotations

from scheduler.hardware import known_gpus

# The scheduler's catalog names. Ascend has no NVML name; static probe files of Ascend nodes use it.
CATALOG_NAMES = known_gpus()

# NVML product name, lower-case and without the "nvidia " prefix -> catalog name.
# Sources, per row: the string NVML / `nvidia-smi -L` reports on that product.
_NVML_TO_CATALOG = {
    "h200": "H200",  # HGX H200 (SXM); the PCIe card reports "NVIDIA H200 NVL"
    "h100 80gb hbm3": "H100-SXM",  # HGX H100 (SXM5); PCIe reports "NVIDIA H100 PCIe"
    "a100-sxm4-80gb": "A100-80G",
    "a100-sxm4-40gb": "A100-40G",
    "l40s": "L40S",
    "a10g": "A10G",  # AWS G5 instances
}


def normalise_nvml_name(name: str) -> str:
    key = " ".join(name.split()).lower()
    return key.removeprefix("nvidia ")


def catalog_name(nvml_name: str) -> str | None:
    """The catalog name of a GPU by its NVML name, or None when the catalog has no such GPU."""
    return _NVML_TO_CATALOG.get(normalise_nvml_name(nvml_name))
