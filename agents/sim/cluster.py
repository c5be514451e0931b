"""The simulated cluster: which GPUs exist and which of them are ours, as scenario events unfold.

It knows nothing about serving; it answers "what would the agents on these nodes see now?".
Which GPUs an event takes is drawn from the injected, seeded `random.Random` (SCENARIOS.md:
"not always the first ones"), so the same seed gives the same story.
"""

from __future__ import annotations

import random
import uuid as uuidlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agents.sim.scenario import EventSpec, NodeSpec, Scenario

US, TENANT, FAILED = "us", "tenant", "failed"

# A fixed namespace so a GPU's UUID is the same in every run of the same scenario.
_GPU_NS = uuidlib.UUID("6f1c7a52-3b0e-4c1e-9a55-0f1e9b7d2c40")


@dataclass
class SimGpu:
    node_id: str
    index: int
    uuid: str
    model: str
    nvlink_group: str | None
    owner: str = US  # us | tenant (another tenant holds it) | failed
    back_at_s: float | None = None  # a timed preempt/fail gives it back at this time
    xid_errors: int = 0
    ecc_errors: int = 0

    @property
    def ours(self) -> bool:
        return self.owner == US


@dataclass
class SimNode:
    spec: NodeSpec
    gpus: list[SimGpu] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.spec.id


@dataclass(frozen=True)
class Change:
    """What one applied event did, for logs and for the agents to report at once."""

    at_s: float
    kind: str
    node: str | None
    gpus: tuple[int, ...] = ()
    text: str = ""


class SimCluster:
    """Nodes present now, their GPUs and owners; link bandwidths including degradations."""

    def __init__(self, scenario: Scenario, rng: random.Random,
                 uuids: Mapping[tuple[str, int], str] | None = None) -> None:
        self.scenario = scenario
        self.rng = rng
        self.uuids = dict(uuids or {})  # (node, index) -> a given GPU uuid (a cluster built from a Snapshot)
        self.nodes: dict[str, SimNode] = {}
        self.now_s = 0.0
        self._pending = list(scenario.events)  # sorted by (at_s, index)
        self._degraded: dict[frozenset[str], tuple[float, float | None]] = {}  # pair -> (gbps, until)
        for spec in scenario.nodes:
            self._add_node(spec)

    # -- queries ---------------------------------------------------------------------------
    def gpu_uuid(self, node_id: str, index: int) -> str:
        given = self.uuids.get((node_id, index))
        if given is not None:
            return given
        return "GPU-" + str(uuidlib.uuid5(_GPU_NS, f"{self.scenario.name}/{node_id}/{index}"))

    def our_gpus(self, node_id: str) -> list[SimGpu]:
        node = self.nodes.get(node_id)
        return [g for g in node.gpus if g.ours] if node else []

    def link_gbps(self, a: str, b: str) -> float:
        pair = frozenset((a, b))
        if pair in self._degraded:
            return self._degraded[pair][0]
        return self.scenario.network.bw_gbps(self.nodes[a].spec, self.nodes[b].spec)

    def links_of(self, node_id: str) -> list[tuple[str, float]]:
        return [(peer, self.link_gbps(node_id, peer)) for peer in sorted(self.nodes) if peer != node_id]

    def next_change_s(self) -> float | None:
        """Time of the next scheduled event or timed return, if any."""
        times = [e.at_s for e in self._pending]
        times += [g.back_at_s for n in self.nodes.values() for g in n.gpus if g.back_at_s is not None]
        times += [until for _, until in self._degraded.values() if until is not None]
        return min(times) if times else None

    # -- time ------------------------------------------------------------------------------
    def advance_to(self, t_s: float) -> list[Change]:
        """Apply, in time order, every event and timed return due at or before t_s."""
        changes: list[Change] = []
        while True:
            nxt = self.next_change_s()
            if nxt is None or nxt > t_s:
                break
            self.now_s = max(self.now_s, nxt)
            changes.extend(self._returns_due(nxt))
            while self._pending and self._pending[0].at_s <= nxt:
                changes.append(self.apply(self._pending.pop(0)))
        self.now_s = max(self.now_s, t_s)
        return changes

    def _returns_due(self, t_s: float) -> list[Change]:
        out: list[Change] = []
        for node in self.nodes.values():
            back = [g for g in node.gpus if g.back_at_s is not None and g.back_at_s <= t_s]
            for g in back:
                g.owner, g.back_at_s = US, None
            if back:
                out.append(Change(t_s, "return", node.id, tuple(g.index for g in back),
                                  f"{len(back)} GPU(s) of {node.id} came back"))
        for pair, (_, until) in list(self._degraded.items()):
            if until is not None and until <= t_s:
                del self._degraded[pair]
                a, b = sorted(pair)
                out.append(Change(t_s, "link_restored", a, (), f"link {a}-{b} restored"))
        return out

    def set_owner(self, uuids: Iterable[str], owner: str, at_s: float) -> Change | None:
        """These GPUs change hands now - another tenant takes them (`TENANT`), they fail (`FAILED`)
        or come back to us (`US`) - as an injected change rather than a scenario event; the
        change, or None when none of them is here or changed."""
        if owner not in (US, TENANT, FAILED):
            raise ValueError(f"owner: must be one of {US}, {TENANT}, {FAILED}, got {owner!r}")
        wanted = set(uuids)
        hit = [g for n in self.nodes.values() for g in n.gpus if g.uuid in wanted and g.owner != owner]
        if not hit:
            return None
        for g in hit:
            g.owner, g.back_at_s = owner, None
            if owner == FAILED:
                g.xid_errors += 1
        nodes = sorted({g.node_id for g in hit})
        kind = {US: "return", TENANT: "preempt", FAILED: "fail"}[owner]
        return Change(at_s, kind, nodes[0], tuple(sorted(g.index for g in hit)),
                      f"{kind}: {len(hit)} GPU(s) of {', '.join(nodes)} ({owner})")

    def apply(self, ev: EventSpec) -> Change:
        if ev.kind in ("preempt", "fail"):
            node = self.nodes.get(ev.node or "")
            if node is None:
                return Change(ev.at_s, ev.kind, ev.node, (), f"{ev.node} is not in the cluster")
            # Another tenant takes GPUs we hold; a failure can hit any GPU that is not failed yet.
            pool = [g for g in node.gpus if g.ours] if ev.kind == "preempt" else [
                g for g in node.gpus if g.owner != FAILED]
            taken = self.rng.sample(pool, k=min(ev.gpus or 0, len(pool)))
            until = ev.at_s + ev.duration_s if ev.duration_s else None
            for g in taken:
                g.owner = TENANT if ev.kind == "preempt" else FAILED
                g.back_at_s = until
                if ev.kind == "fail":
                    g.xid_errors += 1  # a failed GPU shows up as an XID (e.g. 79: fallen off the bus)
            idx = tuple(sorted(g.index for g in taken))
            return Change(ev.at_s, ev.kind, node.id, idx, f"{ev.kind}: {len(taken)} GPU(s) of {node.id} taken")
        if ev.kind == "restore":
            node = self.nodes.get(ev.node or "")
            if node is None:
                return Change(ev.at_s, ev.kind, ev.node, (), f"{ev.node} is not in the cluster")
            back = [g for g in node.gpus if not g.ours]
            for g in back:
                g.owner, g.back_at_s = US, None
            return Change(ev.at_s, "restore", node.id, tuple(g.index for g in back),
                          f"restore: {len(back)} GPU(s) of {node.id} back")
        if ev.kind == "join":
            assert ev.join is not None  # noqa: S101 - the scenario loader guarantees it
            self._add_node(ev.join)
            return Change(ev.at_s, "join", ev.join.id, (), f"{ev.join.id} joined with {ev.join.gpus} GPU(s)")
        if ev.kind == "leave":
            self.nodes.pop(ev.node or "", None)
            for pair in [p for p in self._degraded if ev.node in p]:
                del self._degraded[pair]
            return Change(ev.at_s, "leave", ev.node, (), f"{ev.node} left")
        if ev.kind == "degrade_link":
            assert ev.a and ev.b and ev.gbps is not None  # noqa: S101
            until = ev.at_s + ev.duration_s if ev.duration_s else None
            self._degraded[frozenset((ev.a, ev.b))] = (ev.gbps, until)
            return Change(ev.at_s, "degrade_link", ev.a, (), f"link {ev.a}-{ev.b} down to {ev.gbps} Gb/s")
        raise ValueError(f"kind: unknown event kind {ev.kind!r}")

    def _add_node(self, spec: NodeSpec) -> None:
        node = SimNode(spec)
        group = f"{spec.id}-nvl" if spec.nvlink else None
        for i in range(spec.gpus):
            node.gpus.append(SimGpu(spec.id, i, self.gpu_uuid(spec.id, i), spec.gpu, group))
        # GPUs not free at the start belong to another tenant; which ones is the seed's choice.
        for g in self.rng.sample(node.gpus, k=spec.gpus - spec.free):
            g.owner = TENANT
        self.nodes[spec.id] = node
