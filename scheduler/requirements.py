"""What a registered model version asks of the GPUs it is placed on (the registry's fields, seed 004 §3.1).

    Requirements(min_gpu_mem_bytes, engine)
    Requirements.block_refusal(block, snapshot) -> str | None    why no plan may use the block
    Requirements.plan_refusals(plan, snapshot) -> [str]          why this plan may not run where it is

* `min_gpu_mem_bytes`: the smallest device memory (capacity, not free bytes) a GPU of the plan may
  have - what the registrant knows about the model that the cost model may not (activation peaks,
  a kernel's workspace). A GPU below it is never used, whatever fits on paper.
* `engine`: the backend the version was registered for (vllm | torch). A node whose agent reports
  another backend is not used; a node that reported none is unrestricted (as in capabilities.py),
  and a simulated node (backend `sim`) stands in for any engine - the simulator models timings
  from the cost model, not one engine's code.

The planner keeps every block that a requirement refuses out of its candidates and says so
(`Candidates.excluded`, shown with the decision); an operator's gear on such a GPU is refused with
the same words. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # topology and plan import the planner, which imports this module
    from scheduler.plan import Plan
    from scheduler.topology import AtomicBlock, Snapshot

_GIB = 2**30
ANY_ENGINE = ("sim",)  # backends that stand in for every engine (module docstring)


@dataclass(frozen=True)
class Requirements:
    """A model version's placement requirements; the defaults require nothing."""

    min_gpu_mem_bytes: int = 0  # each GPU's memory capacity at least this
    engine: str | None = None  # the node's engine backend must be this (None: any)
    source: str = ""  # what asks it, for the reasons: "tiny-llama v1"

    def __post_init__(self) -> None:
        if isinstance(self.min_gpu_mem_bytes, bool) or not isinstance(self.min_gpu_mem_bytes, int) \
                or self.min_gpu_mem_bytes < 0:
            raise ValueError(f"min_gpu_mem_bytes: must be an integer >= 0; got {self.min_gpu_mem_bytes!r}")

    @property
    def any(self) -> bool:
        return self.min_gpu_mem_bytes > 0 or self.engine is not None

    def _who(self) -> str:
        return f" of {self.source}" if self.source else ""

    def node_refusal(self, snapshot: Snapshot, node_id: str) -> str | None:
        if self.engine is None:
            return None
        node = snapshot.node_by_id.get(node_id)
        caps = node.engine if node is not None else None
        if caps is None or caps.backend == self.engine or caps.backend in ANY_ENGINE:
            return None
        return (f"node {node_id} runs {caps.backend}, the registered engine{self._who()} is {self.engine}; "
                f"to fix: place it on {self.engine} nodes, or register a {caps.backend} version")

    def gpu_refusal(self, total_bytes: int, where: str) -> str | None:
        if total_bytes >= self.min_gpu_mem_bytes:
            return None
        return (f"{where} has {total_bytes / _GIB:.1f} GiB, below the registered min_gpu_mem_bytes{self._who()} "
                f"({self.min_gpu_mem_bytes / _GIB:.1f} GiB); to fix: GPUs with more memory, or register a "
                "smaller minimum")

    def block_refusal(self, block: AtomicBlock, snapshot: Snapshot) -> str | None:
        """Why no plan may use `block`, or None."""
        why = [self.node_refusal(snapshot, block.node_id)]
        if self.min_gpu_mem_bytes and block.mem_total_bytes:
            why.append(self.gpu_refusal(min(block.mem_total_bytes), f"block {block.id} ({block.gpu_model})"))
        said = [w for w in why if w is not None]
        return "; ".join(said) if said else None

    def plan_refusals(self, plan: Plan, snapshot: Snapshot) -> list[str]:
        """Why `plan` may not run on its GPUs (each GPU and node once), or []."""
        out: list[str] = []
        nodes: list[str] = []
        for u in plan.gpu_uuids:
            g = snapshot.gpu_by_uuid.get(u)
            if g is None:
                continue  # (an unknown GPU is the plan validation's to report)
            if g.node_id not in nodes:
                nodes.append(g.node_id)
            if self.min_gpu_mem_bytes:
                why = self.gpu_refusal(g.mem_total_bytes, f"GPU {g.node_id}/{g.index} ({g.model})")
                if why is not None:
                    out.append(why)
        return out + [w for n in nodes if (w := self.node_refusal(snapshot, n)) is not None]

    def gear_refusals(self, plans: Sequence[Plan], snapshot: Snapshot) -> list[str]:
        return [f"plans[{i}]: {why}" for i, p in enumerate(plans) for why in self.plan_refusals(p, snapshot)]


NONE = Requirements()

__all__ = ["ANY_ENGINE", "NONE", "Requirements"]
