"""What the simulated agents report: the cluster snapshot, each plan's engine metrics, per-GPU
load, each deployment's load sample, and the utilisation accounting at the scenario's end. A
mixin of FleetSim (agents/sim/fleet.py)."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: mypy wants a self type to be a
# supertype of the mixin, which the simulator is not; everything else is checked as usual)

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents.protocol import EngineReport
from agents.sim.cluster import FAILED, TENANT, US
from agents.sim.engine import Event
from agents.sim.scenario import Scenario
from scheduler.gearbox import LoadSample
from scheduler.hardware import gpu_spec
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim


IDLE_MEM_BYTES = 600 * 2**20  # a CUDA context with nothing loaded (as agents/sim/live.py reports)


@dataclass(frozen=True)
class PlanMetrics:
    """One plan's engine metrics over the last report interval, and where it runs."""

    deployment: str
    node_ids: tuple[str, ...]  # nodes hosting its GPUs, in stage order (the agents that report it)
    report: EngineReport  # agents.protocol's shape


class Reports:
    """What FleetSim reports (module docstring)."""

    # ======================================================================================
    # what the controller sees
    # ======================================================================================
    def snapshot(self: FleetSim) -> Snapshot:
        """The cluster as agents would report it now: our plans' memory (weights + KV reserve)
        on their GPUs, other tenants' GPUs unschedulable, failed GPUs unhealthy."""
        if self._snapshot is not None and self._snapshot.now_s == self.now_s:
            return self._snapshot
        now = self.now_s
        used: dict[str, int] = {}
        for fp in self._footprint.values():
            for u, b in fp.items():
                used[u] = used.get(u, 0) + b
        nodes: list[NodeState] = []
        gpus: list[GpuState] = []
        for node_id in sorted(self.cluster.nodes):
            node = self.cluster.nodes[node_id]
            nodes.append(NodeState(id=node_id, rack=node.spec.rack, schedulable=True, last_seen_s=now))
            for g in node.gpus:
                total = self.gpu_mem_bytes(g.uuid)
                if g.owner == TENANT:
                    mem = int(self.tenant_fraction[(node_id, g.index)] * total)
                else:
                    mem = min(total, IDLE_MEM_BYTES + used.get(g.uuid, 0))
                gpus.append(GpuState(
                    uuid=g.uuid, node_id=node_id, index=g.index, model=g.model, mem_total_bytes=total,
                    mem_used_bytes=mem, healthy=g.owner != FAILED, schedulable=g.owner != TENANT,
                    nvlink_group=g.nvlink_group, xid_errors=g.xid_errors, ecc_errors=g.ecc_errors,
                    last_seen_s=now))
        net = self.scenario.network
        snap = self._snapshot = Snapshot(
            now_s=now, nodes=tuple(nodes), gpus=tuple(gpus), links=self._link_states(),
            intra_rack_gbps=net.intra_rack_gbps, inter_rack_gbps=net.inter_rack_gbps)
        return snap

    def _link_states(self: FleetSim) -> tuple[LinkState, ...]:
        """Node pairs whose bandwidth differs from the rack rule (explicit links, degradations)."""
        links = self._links
        if links is None:
            ids = sorted(self.cluster.nodes)
            net = self.scenario.network
            out = []
            for i, a in enumerate(ids):
                for b in ids[i + 1:]:
                    na, nb = self.cluster.nodes[a].spec, self.cluster.nodes[b].spec
                    default = net.intra_rack_gbps if na.rack == nb.rack else net.inter_rack_gbps
                    gbps = self.cluster.link_gbps(a, b)
                    if gbps != default:
                        out.append(LinkState(a=a, b=b, bw_gbps=gbps))
            links = self._links = tuple(out)
        return links

    def load_sample(self: FleetSim, deployment: str, t: float) -> LoadSample | None:
        """The deployment's load since the previous sample (what its agents' engine reports sum
        to): arrivals per second, prompt lengths of the arrivals, output lengths of the requests
        that finished. None for an empty interval."""
        dep = self._dep(deployment)
        span = t - dep.win_since_s
        if span <= 0:
            return None
        n, f = dep.win_arrivals, dep.win_finished
        prompt_mean = dep.win_prompt / n if n else 1.0
        if f:
            dep.last_output_mean = dep.win_output / f
        output_mean = dep.last_output_mean or _expected_output(self.scenario, deployment)
        sample = LoadSample(
            t_s=t, rate_rps=n / span, prompt_tokens_mean=max(1.0, prompt_mean),
            output_tokens_mean=max(1.0, output_mean),
            prompt_tokens_cv=_cv(n, dep.win_prompt, dep.win_prompt_sq, 1.0),
            output_tokens_cv=_cv(f, dep.win_output, dep.win_output_sq, 0.6),
            backlog=self.backlog(deployment),
        )
        dep.win_arrivals = dep.win_finished = 0
        dep.win_prompt = dep.win_prompt_sq = dep.win_output = dep.win_output_sq = 0.0
        dep.win_since_s = t
        return sample

    def backlog(self: FleetSim, deployment: str) -> int:
        """Requests of the deployment waiting for admission: in its plans' queues (what their
        engines report as waiting) and in its own queue while no plan can take them."""
        dep = self._dep(deployment)
        waiting = sum(len(p.waiting) for e in self.live.values() if e.deployment == deployment for p in e.pipes)
        return waiting + len(dep.pending)

    def plans_on(self: FleetSim, node_id: str) -> set[str]:
        """The plans with an engine on this node's GPUs now (loading, serving, draining), as leader
        or member: what its agent says it runs (agents.protocol.Report.plans). A plan whose GPUs
        failed or were taken stopped (FleetSim) and is not among them, even once they are back."""
        return {e.plan.plan_id for e in self.live.values() if node_id in self._plan_nodes(e.plan)}

    def engine_reports(self: FleetSim, leader: str | None = None) -> list[PlanMetrics]:
        """Per serving plan, its engine metrics since the previous call (agents.protocol's
        EngineReport), with the nodes that host it. With `leader`, only the plans whose first
        node that is - the live fleet's agents report at their own times, and each must reset
        only the counters of the plans it reports."""
        t = self.now_s
        out: list[PlanMetrics] = []
        for engine in sorted(self.live.values(), key=lambda e: e.engine_id):
            if engine.state != "serving":
                continue
            if leader is not None and self._plan_nodes(engine.plan)[0] != leader:
                continue
            span = t - max(engine.rep_since_s, engine.started_s)
            running = sum(len(p.running) for p in engine.pipes) + len(engine.in_flight)
            waiting = sum(len(p.waiting) for p in engine.pipes)
            kv = max(p.kv_used / p.kv_cap if p.kv_cap else 0.0 for p in engine.pipes)
            report = EngineReport(
                plan_id=engine.plan.plan_id, running=running, waiting=waiting,
                tokens_per_s=round(engine.rep_tokens / span, 3) if span > 0 else 0.0,
                kv_usage=round(min(1.0, kv), 4),
                ttft_p50_ms=_ms(engine.rep_ttft, 50), ttft_p95_ms=_ms(engine.rep_ttft, 95),
                tpot_p50_ms=_ms(engine.rep_tpot, 50), tpot_p95_ms=_ms(engine.rep_tpot, 95),
                finished=engine.rep_finished, arrivals=engine.rep_arrivals, slo_violations=engine.rep_violations,
                prompt_tokens_mean=_mean(engine.rep_prompt), output_tokens_mean=_mean(engine.rep_output))
            nodes = tuple(dict.fromkeys(self._plan_nodes(engine.plan)))
            out.append(PlanMetrics(engine.deployment, nodes, report))
            engine.rep_tokens = engine.rep_finished = engine.rep_arrivals = engine.rep_violations = 0
            engine.rep_ttft, engine.rep_tpot, engine.rep_prompt, engine.rep_output = [], [], [], []
            engine.rep_since_s = t
        return out

    def gpu_load(self: FleetSim) -> dict[tuple[str, int], tuple[float, float]]:
        """(node, GPU index) -> (memory used fraction, utilisation) for every GPU of a plan (what
        agents/sim/live.py reports as SM utilisation). Utilisation is the share of the time
        since the previous call in which the plan ran rounds."""
        t = self.now_s
        span = t - self._gpu_load_t
        by_uuid = self._gpus_by_uuid()
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for engine in self.live.values():
            busy = sum(p.busy_s for p in engine.pipes)
            prev = self._gpu_busy_mark.get(engine.engine_id, busy if engine.state != "serving" else 0.0)
            util = min(1.0, max(0.0, (busy - prev) / span)) if span > 0 else 0.0
            self._gpu_busy_mark[engine.engine_id] = busy
            for u, b in self._footprint.get(engine.engine_id, {}).items():
                g = by_uuid.get(u)
                if g is None:
                    continue
                total = self.gpu_mem_bytes(g.uuid)
                out[(g.node_id, g.index)] = (min(1.0, (IDLE_MEM_BYTES + b) / total), round(util, 3))
        self._gpu_load_t = t
        return out

    # ======================================================================================
    # accounting
    # ======================================================================================
    def _account_availability(self: FleetSim, t: float) -> None:
        span = min(t, self.scenario.duration_s) - self._avail_t
        if span > 0:
            ours = [g for n in self.cluster.nodes.values() for g in n.gpus if g.owner == US]
            self._avail_mem_byte_s += span * sum(self.gpu_mem_bytes(g.uuid) for g in ours)
            self._avail_flop += span * sum(gpu_spec(g.model).bf16_flops for g in ours)
            self._avail_t = min(t, self.scenario.duration_s)


    def _mark_duration(self: FleetSim, t: float, _: object) -> list[Event]:
        """At duration_s: freeze the utilisation figures (the drain does not count)."""
        self._account_availability(t)
        flop = kv_byte_s = weight_byte_s = 0.0
        held: dict[str, list[tuple[float, float]]] = {}  # GPU -> the spans our plans held it
        for engine in self.engines.values():
            per_token = float(engine.model.linear_flops_per_token)
            for pipe in engine.pipes:
                flop += pipe.tokens_done * per_token
                kv_byte_s += pipe.kv_token_s * pipe.kv_bytes_per_token
            up = engine.started_s if engine.state != "loading" else t
            end = min(self._ended_s.get(engine.engine_id, t), t)
            if engine.state in ("serving", "released", "dead") and end > up:
                weight_byte_s += engine.weight_bytes * (end - up)
            # GPUs held: from launch (memory is held while loading) to release, within [0, t]
            held_end = min(self._ended_s.get(engine.engine_id, t), t)
            if held_end > engine.launched_s:
                for u in engine.plan.gpu_uuids:
                    held.setdefault(u, []).append((engine.launched_s, held_end))
        mem = (weight_byte_s + kv_byte_s) / self._avail_mem_byte_s if self._avail_mem_byte_s else 0.0
        compute = flop / self._avail_flop if self._avail_flop else 0.0
        self.recorder.util = (min(1.0, mem), min(1.0, compute))
        # a GPU two plans share (two models by memory fraction, or a switch's old and new plan) is one
        # GPU held: each GPU's spans are merged before they are summed
        self.recorder.gpu_hours = sum(_union_s(spans) for spans in held.values()) / 3600
        return []



def _cv(n: int, total: float, sq: float, default: float) -> float:
    if n < 2 or total <= 0:
        return default
    mean = total / n
    var = max(0.0, sq / n - mean * mean)
    return math.sqrt(var) / mean


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, int(math.ceil(q / 100 * len(s))) - 1))
    return round(s[i] * 1e3, 3)


def _mean(values: list[int]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _expected_output(scenario: Scenario, deployment: str) -> float:
    for w in scenario.workload:
        if w.deployment == deployment:
            if w.output_tokens is not None:
                return max(1.0, w.output_tokens.expected())
            if w.trace:
                return sum(r.output_tokens for r in w.trace) / len(w.trace)
    return 128.0


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total
