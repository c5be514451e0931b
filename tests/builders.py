"""Builders for wire messages and fleet state, so tests say only what matters to them."""

from __future__ import annotations

from typing import Any

GIB = 2**30
JOIN_TOKEN = "fpj_test-join-token"


def gpu_info(node_id: str, index: int, *, model: str = "H100-SXM", mem_gib: int = 80,
             nvlink_group: str | None = "nvl0") -> dict[str, Any]:
    return {"uuid": f"GPU-{node_id}-{index}", "index": index, "model": model,
            "mem_total_bytes": mem_gib * GIB, "nvlink_group": nvlink_group}


def register_body(node_id: str = "a1", *, gpus: int = 4, **gpu_kw: Any) -> dict[str, Any]:
    return {
        "protocol": 1,
        "node_id": node_id,
        "hostname": f"{node_id}.example",
        "agent_version": "test",
        "rack": "A",
        "gpus": [gpu_info(node_id, i, **gpu_kw) for i in range(gpus)],
    }


def gpu_report(node_id: str, index: int, *, used_gib: float = 10, mem_gib: int = 80, sm_util: float = 0.5,
               healthy: bool = True, allocatable: bool = True) -> dict[str, Any]:
    return {"uuid": f"GPU-{node_id}-{index}", "mem_used_bytes": int(used_gib * GIB), "mem_total_bytes": mem_gib * GIB,
            "sm_util": sm_util, "temperature_c": 55.0, "healthy": healthy, "allocatable": allocatable,
            "xid_errors": 0, "ecc_errors": 0}


def report_body(node_id: str = "a1", *, epoch: int = 1, seq: int = 1, gpus: int = 4,
                **gpu_kw: Any) -> dict[str, Any]:
    return {
        "protocol": 1,
        "node_id": node_id,
        "epoch": epoch,
        "seq": seq,
        "gpus": [gpu_report(node_id, i, **gpu_kw) for i in range(gpus)],
        "links": [],
        "engines": [],
    }
