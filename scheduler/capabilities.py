"""What a node's engine can run: its capabilities, as its agent reports them, and the one check.

An agent reports, per engine backend it runs, what plans that engine can serve (agent
protocol v1, `RegisterRequest.capabilities`, schema version `CAPS_VERSION`). The console puts
the node's active backend's capabilities on the snapshot (`topology.NodeState.engine`); the
planner proposes only plans every node of which can run them (and says why it left the others
out), the cost model prices sequence moves by replay where an engine cannot move KV, and every
agent - the real daemon and the simulated fleets - refuses a PREPARE its engine cannot run with
`plan_refusals`' words. A node that reported nothing (`engine` None) is not restricted.

JSON shape (`EngineCaps.to_dict` / `from_dict`):

    {"backend": "vllm", "version": 1, "modes": ["colocated"], "tp_sizes": null, "max_pp": 8,
     "mixed_tp": false, "kv_migration": false, "cross_node": false, "shares_weights": false,
     "mem_fraction": 0.9}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plan and topology import this module
    from scheduler.plan import Plan
    from scheduler.topology import Snapshot

CAPS_VERSION = 1  # version of the capability schema below (agents report it; a newer one is refused)
MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class EngineCaps:
    """What one engine backend can run."""

    backend: str  # torch | vllm | sim
    version: int = CAPS_VERSION  # schema version
    modes: tuple[str, ...] = MODES  # plan modes it serves
    tp_sizes: tuple[int, ...] | None = None  # TP degrees it runs; None: any the model allows
    max_pp: int = 64  # most pipeline stages of one plan
    mixed_tp: bool = True  # stages of one plan may have different TP degrees
    kv_migration: bool = True  # False: sequences reach or leave it by replay only
    cross_node: bool = True  # a plan may span this node and others (PP, or prefill/decode split)
    shares_weights: bool = False  # a new plan maps an old plan's resident weight shards in place
    mem_fraction: float | None = None  # share of each GPU the engine takes whatever the plan (vLLM); None: the plan's

    def __post_init__(self) -> None:
        if not self.backend:
            raise ValueError("backend: must be a non-empty string")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes: must be a non-empty list of {', '.join(MODES)}; got {list(self.modes)}")
        if self.tp_sizes is not None and (not self.tp_sizes or any(t < 1 for t in self.tp_sizes)):
            raise ValueError(f"tp_sizes: must be null or integers >= 1; got {list(self.tp_sizes)}")
        if self.max_pp < 1:
            raise ValueError(f"max_pp: must be >= 1; got {self.max_pp}")
        if self.mem_fraction is not None and not (0.0 < self.mem_fraction <= 1.0 and math.isfinite(self.mem_fraction)):
            raise ValueError(f"mem_fraction: must be within (0, 1] or null; got {self.mem_fraction}")

    def allows_tp(self, tp: int) -> bool:
        return self.tp_sizes is None or tp in self.tp_sizes

    def to_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "version": self.version, "modes": list(self.modes),
                "tp_sizes": None if self.tp_sizes is None else list(self.tp_sizes), "max_pp": self.max_pp,
                "mixed_tp": self.mixed_tp, "kv_migration": self.kv_migration, "cross_node": self.cross_node,
                "shares_weights": self.shares_weights, "mem_fraction": self.mem_fraction}

    @classmethod
    def from_dict(cls, d: object, path: str = "engine") -> EngineCaps:
        """Parse the JSON shape (module docstring); ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object")
        known = {"backend", "version", "modes", "tp_sizes", "max_pp", "mixed_tp", "kv_migration", "cross_node",
                 "shares_weights", "mem_fraction"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key")
        backend = d.get("backend")
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"{path}.backend: must be a non-empty string")
        version = d.get("version", CAPS_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CAPS_VERSION:
            raise ValueError(f"{path}.version: must be an integer within [1, {CAPS_VERSION}]; got {version!r}")
        modes = d.get("modes", list(MODES))
        if not isinstance(modes, list) or not modes or any(m not in MODES for m in modes):
            raise ValueError(f"{path}.modes: must be a non-empty list of {', '.join(MODES)}; got {modes!r}")
        tps = d.get("tp_sizes")
        if tps is not None and (not isinstance(tps, list) or not tps or any(
                isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 64 for t in tps)):
            raise ValueError(f"{path}.tp_sizes: must be null or a list of integers within [1, 64]; got {tps!r}")
        max_pp = d.get("max_pp", 64)
        if isinstance(max_pp, bool) or not isinstance(max_pp, int) or not 1 <= max_pp <= 256:
            raise ValueError(f"{path}.max_pp: must be an integer within [1, 256]; got {max_pp!r}")
        flags: dict[str, bool] = {}
        for key, default in (("mixed_tp", True), ("kv_migration", True), ("cross_node", True),
                             ("shares_weights", False)):
            value = d.get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"{path}.{key}: must be true or false; got {value!r}")
            flags[key] = value
        frac = d.get("mem_fraction")
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, int | float)
                                 or not math.isfinite(frac) or not 0 < frac <= 1):
            raise ValueError(f"{path}.mem_fraction: must be null or a number within (0, 1]; got {frac!r}")
        return cls(backend=backend, version=version, modes=tuple(modes),
                   tp_sizes=None if tps is None else tuple(sorted(set(tps))), max_pp=max_pp,
                   mem_fraction=None if frac is None else float(frac), **flags)


# The engines this project ships, as their agents report them.
# torch reference engine (agents/engines/torch): colocated and disaggregated layouts, PP across
# nodes over torch.distributed, KV export/import between plans (kvtransfer.py); it loads its own
# copy of the weights for every plan (no in-place sharing).
TORCH_CAPS = EngineCaps(backend="torch")
# vLLM adapter (agents/dataplane/vllm_host.py; agents/engines/vllm/spec.py vllm_spec_for_plan): one server per plan on the
# leader's machine, colocated only, one TP size for every stage, sequences move by replay (vLLM
# cannot export or import KV); it preallocates `gpu_memory_utilization` of each GPU, 0.9 unless
# set (vLLM's EngineArgs default, vllm/engine/arg_utils.py).
VLLM_CAPS = EngineCaps(backend="vllm", modes=("colocated",), mixed_tp=False, kv_migration=False, cross_node=False,
                       mem_fraction=0.9)
# the simulated engines (agents/sim): what the torch engine runs
SIM_CAPS = EngineCaps(backend="sim")
DEFAULT_CAPS = {"torch": TORCH_CAPS, "vllm": VLLM_CAPS, "sim": SIM_CAPS}


def plan_refusals(plan: Plan, snapshot: Snapshot) -> list[str]:
    """Why the engines of `plan`'s nodes cannot run it (empty: they can). The planner's filter
    and every agent's PREPARE check, in one wording: "node b1 (vllm): ...". GPUs missing from
    the snapshot are another check's business."""
    gpus = snapshot.gpu_by_uuid
    nodes_of_stage = [sorted({gpus[u].node_id for u in st.gpu_uuids if u in gpus}) for st in plan.all_stages]
    nodes = sorted({n for ns in nodes_of_stage for n in ns})
    return engine_refusals(plan, nodes, {n: snapshot.node_by_id[n].engine for n in nodes if n in snapshot.node_by_id})


def engine_refusals(plan: Plan, nodes: Sequence[str], engines: Mapping[str, EngineCaps | None]) -> list[str]:
    """`plan_refusals` for a plan placed on `nodes`, given each node's engine."""
    out: list[str] = []
    tps = sorted({st.tp for st in plan.all_stages})
    pipelines = [p for p in plan.pipelines if p]
    longest = max((len(p) for p in pipelines), default=0)
    for node in nodes:
        caps = engines.get(node)
        if caps is None:
            continue
        who = f"node {node} ({caps.backend})"
        if plan.mode not in caps.modes:
            out.append(f"{who} cannot run {plan.mode} plans (it runs {', '.join(caps.modes)})")
        bad_tp = [t for t in tps if not caps.allows_tp(t)]
        if bad_tp:
            out.append(f"{who} cannot run TP {', '.join(map(str, bad_tp))} (it runs TP "
                       f"{', '.join(map(str, caps.tp_sizes or ()))})")
        if longest > caps.max_pp:
            out.append(f"{who} runs at most {caps.max_pp} pipeline stage(s), the plan has {longest}")
        if not caps.mixed_tp and any(len({st.tp for st in p}) > 1 for p in pipelines):
            out.append(f"{who} runs one TP size for every stage of a plan")
        if not caps.cross_node and len(nodes) > 1:
            out.append(f"{who} cannot run a plan that spans nodes ({', '.join(nodes)})")
    return out


def migrates_kv(snapshot: Snapshot, node_ids: Sequence[str]) -> bool:
    """Whether KV can move between the engines of these nodes (False: replay only)."""
    for n in node_ids:
        node = snapshot.node_by_id.get(n)
        if node is not None and node.engine is not None and not node.engine.kv_migration:
            return False
    return True


def mem_fraction_of(snapshot: Snapshot, node_id: str, default: float) -> float:
    """The share of a GPU a plan on this node may book: the invariant's, or less where the
    engine takes a fixed share of its own."""
    node = snapshot.node_by_id.get(node_id)
    if node is None or node.engine is None or node.engine.mem_fraction is None:
        return default
    return min(default, node.engine.mem_fraction)


__all__ = [
    "CAPS_VERSION", "DEFAULT_CAPS", "EngineCaps", "SIM_CAPS", "TORCH_CAPS", "VLLM_CAPS", "engine_refusals",
    "mem_fraction_of", "migrates_kv", "plan_refusals",
]
