"""Probes: what an agent knows about its node's GPUs.

A probe answers two questions, matching the two agent messages of agents/protocol/:
`gpus()` — the static facts sent once at registration (`GpuInfo`), and `report()` — the
changing state sent with every report (`GpuReport`). Two kinds exist:

    nvml    real NVIDIA GPUs through nvidia-ml-py (agents/probes/nvml.py)
    static  a JSON/YAML file that describes the GPUs (agents/probes/static.py)

`open_probe(kind, ...)` is what the agent daemon calls; an unknown kind is a ValueError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from agents.protocol import GpuInfo, GpuReport

PROBE_KINDS = ("nvml", "static")


class NoGpuError(RuntimeError):
    """The machine has no usable NVIDIA GPU or driver. The message is one line for the operator."""


class Probe(Protocol):
    def gpus(self) -> tuple[GpuInfo, ...]:
        """The node's GPUs as registered (stable for the probe's life)."""
        ...

    def report(self) -> tuple[GpuReport, ...]:
        """The GPUs' state now, in the order of `gpus()`."""
        ...

    def close(self) -> None: ...


def open_probe(kind: str, *, static_path: str | Path | None = None, nvml: Any = None) -> Probe:
    """Open a probe by name. `nvml` replaces pynvml (a recorded source in tests)."""
    if kind == "nvml":
        from agents.probes.nvml import NvmlProbe

        return NvmlProbe.open(nvml)
    if kind == "static":
        if static_path is None:
            raise ValueError("static_path: the static probe needs a file describing the node's GPUs")
        from agents.probes.static import StaticProbe

        return StaticProbe(static_path)
    raise ValueError(f"probe: must be one of {', '.join(PROBE_KINDS)}; got {kind!r}")
