"""Small scenarios for simulator tests: seconds of CPU each, built as documents so a test can
change one key and say why."""

from __future__ import annotations

import copy
from typing import Any

from agents.sim.scenario import Scenario, parse_scenario

CHAT = {"deployment": "chat", "model": "Llama-3-8B", "slo": {"ttft_ms": 500, "tpot_ms": 50}, "priority": 10,
        "baseline": {"tp": 2, "nodes": ["a1"]}}
SUM = {"deployment": "sum", "model": "Llama-3-70B", "slo": {"ttft_ms": 3000, "tpot_ms": 120}, "priority": 5,
       "baseline": {"tp": 4, "nodes": ["a1"]}}

LIVELY: dict[str, Any] = {
    "name": "lively",
    "seed": 5,
    "duration_s": 900,
    "nodes": [
        {"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"},
        {"id": "b1", "gpu": "A100-80G", "gpus": 4, "nvlink": True, "rack": "B"},
        {"id": "c1", "gpu": "L40S", "gpus": 2, "nvlink": False, "rack": "B"},
    ],
    "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
    "models": [CHAT, SUM],
    "workload": [
        {"deployment": "chat", "arrival": "poisson", "rate_rps": [[0, 3], [450, 5], [900, 3]],
         "prompt_tokens": {"dist": "lognormal", "mean": 400, "sigma": 0.6, "max": 3000},
         "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.5, "max": 600}},
        {"deployment": "sum", "arrival": "poisson", "rate_rps": 0.3,
         "prompt_tokens": {"dist": "lognormal", "mean": 2500, "sigma": 0.4, "max": 6000},
         "output_tokens": {"dist": "lognormal", "mean": 150, "sigma": 0.4, "max": 600}},
    ],
    "events": [
        {"at_s": 200, "kind": "preempt", "node": "a1", "gpus": 4, "duration_s": 300},
        {"at_s": 450, "kind": "fail", "node": "b1", "gpus": 1},
        {"at_s": 700, "kind": "restore", "node": "b1"},
    ],
}


def lively(**changes: Any) -> Scenario:
    doc = copy.deepcopy(LIVELY)
    doc.update(changes)
    return parse_scenario(doc)


def one_deployment(*, rate_rps: Any = 2.0, duration_s: float = 600, prompt: dict[str, Any] | None = None,
                   output: dict[str, Any] | None = None, model: str = "Llama-3-8B", tp: int = 1, gpus: int = 8,
                   gpu: str = "H100-SXM", events: list[dict[str, Any]] | None = None, seed: int = 3,
                   nodes: list[dict[str, Any]] | None = None) -> Scenario:
    """One deployment on one node (more with `nodes`), constant or piecewise load."""
    doc = {
        "name": "one", "seed": seed, "duration_s": duration_s,
        "nodes": nodes or [{"id": "a1", "gpu": gpu, "gpus": gpus, "nvlink": True, "rack": "A"}],
        "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
        "models": [{"deployment": "d", "model": model, "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                    "baseline": {"tp": tp, "nodes": ["a1"]}}],
        "workload": [{"deployment": "d", "arrival": "poisson", "rate_rps": rate_rps,
                      "prompt_tokens": prompt or {"dist": "fixed", "value": 500},
                      "output_tokens": output or {"dist": "fixed", "value": 100}}],
        "events": events or [],
    }
    return parse_scenario(doc)
