"""Scenario files: a cluster, the models deployed on it, the load, and what happens over time.

The format is ../shared/SCENARIOS.md (user documentation: docs/scenarios.md). One loader serves
the simulator, the live simulated fleet and the replay benchmark. Validation is complete and
strict: unknown keys are errors and every error names the path of the offending key
(`events[3].node: unknown node 'x9'`), all of them at once. The load's part (arrivals, length
distributions, traces, rate series) is read by agents/sim/scenario_load.py.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agents.schema import ObjectReader, Problems, SchemaError, read_document
from agents.sim.scenario_load import WorkloadSpec, read_workload
from scheduler.pool.jobs import JOB_PRIORITY, Job

EVENT_KINDS = ("preempt", "fail", "restore", "join", "leave", "degrade_link")


@dataclass(frozen=True)
class NodeSpec:
    id: str
    gpu: str  # a GPU name of scheduler.hardware's catalog
    gpus: int  # GPUs in the node
    nvlink: bool  # True: one NVLink/NVSwitch domain; False: PCIe only
    rack: str  # default: a rack of its own, named after the node
    free: int  # GPUs free for us at t=0
    host_kv_gib: float | None = None  # host memory for KV tiers (agents/sim/kvtiers.py); None: the default
    ssd_kv_gib: float | None = None  # SSD for KV tiers; None: the default


@dataclass(frozen=True)
class LinkSpec:
    a: str
    b: str
    gbps: float


@dataclass(frozen=True)
class NetworkSpec:
    intra_rack_gbps: float
    inter_rack_gbps: float
    links: tuple[LinkSpec, ...] = ()

    def bw_gbps(self, a: NodeSpec, b: NodeSpec) -> float:
        """Bandwidth between two nodes: an explicit link wins, then the rack rule."""
        for link in self.links:
            if {link.a, link.b} == {a.id, b.id}:
                return link.gbps
        return self.intra_rack_gbps if a.rack == b.rack else self.inter_rack_gbps


@dataclass(frozen=True)
class BaselineSpec:
    tp: int
    pp: int
    nodes: tuple[str, ...]  # nodes whose free GPUs it uses, in pipeline order


@dataclass(frozen=True)
class ModelDeploymentSpec:
    deployment: str
    model: str  # a name of scheduler.modelspec's catalog
    ttft_ms: float
    tpot_ms: float
    priority: int
    baseline: BaselineSpec
    idle_to_zero_s: float | None = None  # scale to zero after this long without arrivals (None: never)
    min_replicas: int = 1  # 0 lets it scale to zero (needed with idle_to_zero_s)


@dataclass(frozen=True)
class EventSpec:
    at_s: float
    kind: str
    node: str | None = None  # preempt, fail, restore, leave; for join the new node's id
    gpus: int | None = None  # preempt, fail: how many GPUs the event takes
    duration_s: float | None = None  # preempt, fail, degrade_link: back by itself after this long
    join: NodeSpec | None = None  # join: the node that arrives
    a: str | None = None  # degrade_link
    b: str | None = None
    gbps: float | None = None
    index: int = 0  # position in the file, for messages and stable ordering


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    duration_s: float
    time_scale: float
    nodes: tuple[NodeSpec, ...]
    network: NetworkSpec
    models: tuple[ModelDeploymentSpec, ...]
    workload: tuple[WorkloadSpec, ...]
    events: tuple[EventSpec, ...] = ()
    jobs: tuple[Job, ...] = ()  # fine-tune and batch jobs on the same GPUs (scheduler/pool/jobs.py)
    source: str = ""  # the file it came from, if any
    extra: dict[str, Any] = field(default_factory=dict)
    # deployments that may share one GPU by memory fraction under flexpipe (scheduler.pool.sharing);
    # None: the loop's default (2, seed 004 section 4.2); 1: exclusive GPUs
    max_models_per_gpu: int | None = None

    def node(self, node_id: str) -> NodeSpec:
        for n in self.all_nodes():
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def all_nodes(self) -> tuple[NodeSpec, ...]:
        """Nodes at t=0 followed by the nodes that join later."""
        joined = tuple(e.join for e in self.events if e.kind == "join" and e.join is not None)
        return self.nodes + joined


def _default_gpu_names() -> Collection[str]:
    from scheduler import hardware

    return hardware.known_gpus()


def _default_model_names() -> Collection[str]:
    from scheduler import modelspec

    return modelspec.known_models()


def load_scenario(path: str | Path, *, gpu_names: Collection[str] | None = None,
                  model_names: Collection[str] | None = None) -> Scenario:
    """Read and validate a scenario file. Raises SchemaError (a ValueError) listing every problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SchemaError({"(file)": f"cannot read {p}: {exc.strerror}"}, "scenario") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SchemaError({"(file)": f"not valid YAML{where}: {getattr(exc, 'problem', exc)}"}, "scenario") from exc
    return parse_scenario(data, base_dir=p.parent, source=str(p), gpu_names=gpu_names, model_names=model_names)


def parse_scenario(data: Any, *, base_dir: Path | None = None, source: str = "",
                   gpu_names: Collection[str] | None = None,
                   model_names: Collection[str] | None = None) -> Scenario:
    gpu_names = set(gpu_names if gpu_names is not None else _default_gpu_names())
    model_names = set(model_names if model_names is not None else _default_model_names())
    r, problems = read_document(data)
    name = r.str("name", max_len=100)
    seed = r.int("seed")
    duration_s = r.num("duration_s", min=0.0, exclusive_min=True)
    time_scale = r.num("time_scale", 1.0, min=0.0, exclusive_min=True)
    max_models = r.int("max_models_per_gpu", None, min=1)

    nodes: list[NodeSpec] = []
    nlist = r.list("nodes", min_len=1)
    known: dict[str, NodeSpec] = {}
    if nlist is not None:
        for nr in nlist.objects():
            node = _read_node(nr, gpu_names)
            if node is None:
                continue
            if node.id in known:
                nr.fail("id", f"duplicate node id {node.id!r}")
                continue
            known[node.id] = node
            nodes.append(node)

    network = _read_network(r.obj("network"), known, problems)
    models = _read_models(r, known, model_names, problems)
    deployments = {m.deployment for m in models}
    workload = read_workload(r, deployments, base_dir, problems)
    events = _read_events(r, dict(known), gpu_names, duration_s, problems)
    jobs = _read_jobs(r, gpu_names, duration_s)
    r.done()
    problems.raise_if_any("scenario")
    return Scenario(
        name=name,
        seed=seed,
        duration_s=duration_s,
        time_scale=time_scale,
        nodes=tuple(nodes),
        network=network,  # type: ignore[arg-type]
        models=tuple(models),
        workload=tuple(workload),
        events=tuple(events),
        jobs=tuple(jobs),
        source=source,
        max_models_per_gpu=max_models,
    )


def _read_node(nr: ObjectReader, gpu_names: set[str]) -> NodeSpec | None:
    node_id = nr.str("id", max_len=64)
    gpu = nr.str("gpu", max_len=64)
    gpus = nr.int("gpus", min=1, max=64)
    nvlink = nr.bool("nvlink")
    rack = nr.str("rack", None, max_len=64)
    free = nr.int("free", None, min=0)
    host_kv = nr.num("host_kv_gib", None, min=0.0)
    ssd_kv = nr.num("ssd_kv_gib", None, min=0.0)
    nr.done()
    if gpu is not None and gpu not in gpu_names:
        nr.fail("gpu", f"unknown GPU {gpu!r}; known: {', '.join(sorted(gpu_names))}")
        gpu = None
    if free is not None and gpus is not None and free > gpus:
        nr.fail("free", f"must be at most gpus ({gpus}); got {free}")
        free = None
    if None in (node_id, gpu, gpus, nvlink):
        return None
    return NodeSpec(node_id, gpu, gpus, nvlink, rack or node_id, gpus if free is None else free, host_kv, ssd_kv)


def _read_network(nr: ObjectReader | None, known: dict[str, NodeSpec], problems: Problems) -> NetworkSpec | None:
    if nr is None:
        return None
    intra = nr.num("intra_rack_gbps", min=0.0, exclusive_min=True)
    inter = nr.num("inter_rack_gbps", min=0.0, exclusive_min=True)
    links: list[LinkSpec] = []
    llist = nr.list("links", [])
    if llist is not None:
        for lr in llist.objects():
            a = lr.str("a")
            b = lr.str("b")
            gbps = lr.num("gbps", min=0.0, exclusive_min=True)
            lr.done()
            for key, value in (("a", a), ("b", b)):
                if value is not None and value not in known:
                    lr.fail(key, f"unknown node {value!r}")
            if a is not None and a == b:
                lr.fail("b", "must differ from a")
            if None not in (a, b, gbps):
                links.append(LinkSpec(a, b, gbps))
    nr.done()
    if intra is None or inter is None:
        return None
    return NetworkSpec(intra, inter, tuple(links))


def _read_models(r: ObjectReader, known: dict[str, NodeSpec], model_names: set[str],
                 problems: Problems) -> list[ModelDeploymentSpec]:
    out: list[ModelDeploymentSpec] = []
    mlist = r.list("models", min_len=1)
    if mlist is None:
        return out
    seen: set[str] = set()
    for mr in mlist.objects():
        dep = mr.str("deployment", max_len=64)
        model = mr.str("model", max_len=64)
        slo = mr.obj("slo")
        ttft = tpot = None
        if slo is not None:
            ttft = slo.num("ttft_ms", min=0.0, exclusive_min=True)
            tpot = slo.num("tpot_ms", min=0.0, exclusive_min=True)
            slo.done()
        priority = mr.int("priority", 0)
        idle = mr.num("idle_to_zero_s", None, min=0.0, exclusive_min=True)
        low = mr.int("min_replicas", 1, min=0)
        if idle is not None and low is not None and low != 0:
            mr.fail("idle_to_zero_s", f"scaling to zero needs min_replicas 0 (it is {low})")
            idle = None
        baseline = None
        br = mr.obj("baseline")
        if br is not None:
            baseline = _read_baseline(br, known)
        mr.done()
        if dep is not None:
            if dep in seen:
                mr.fail("deployment", f"duplicate deployment {dep!r}")
                dep = None
            else:
                seen.add(dep)
        if model is not None and model not in model_names:
            mr.fail("model", f"unknown model {model!r}; known: {', '.join(sorted(model_names))}")
            model = None
        if None not in (dep, model, ttft, tpot, baseline):
            out.append(ModelDeploymentSpec(dep, model, ttft, tpot, priority, baseline,  # type: ignore[arg-type]
                                           idle, low if low is not None else 1))
    return out


def _read_baseline(br: ObjectReader, known: dict[str, NodeSpec]) -> BaselineSpec | None:
    tp = br.int("tp", min=1, max=64)
    pp = br.int("pp", 1, min=1, max=128)
    nodes: list[str] = []
    nl = br.list("nodes", min_len=1)
    ok = True
    if nl is not None:
        for path, item in nl.items():
            if not isinstance(item, str) or item not in known:
                br.problems.add(path, f"unknown node {item!r}")
                ok = False
            elif item in nodes:
                br.problems.add(path, f"node {item!r} listed twice")
                ok = False
            else:
                nodes.append(item)
    br.done()
    if tp is None or pp is None or nl is None or not ok:
        return None
    # Stages fill the listed nodes in order; a TP group never spans two nodes (one atomic block).
    stages_fit = sum(known[n].free // tp for n in nodes)
    if stages_fit < pp:
        where = ", ".join(f"{n}: {known[n].free} free" for n in nodes)
        br.fail("tp", f"{pp} stage(s) of tp={tp} do not fit on the listed nodes' free GPUs ({where}); "
                      "lower tp or pp, or list more nodes")
        return None
    return BaselineSpec(tp, pp, tuple(nodes))


def _read_events(r: ObjectReader, known: dict[str, NodeSpec], gpu_names: set[str],
                 duration_s: float | None, problems: Problems) -> list[EventSpec]:
    out: list[EventSpec] = []
    elist = r.list("events", [])
    if elist is None:
        return out
    readers = list(elist.objects())
    raws = [(er.raw("at_s", None), i) for i, er in enumerate(readers)]
    # Node membership evolves with join/leave, so check events in time order (file order on ties).
    order = sorted(range(len(readers)), key=lambda i: (_sort_key(raws[i][0]), i))
    for i in order:
        er = readers[i]
        at_s = er.num("at_s", min=0.0)
        if at_s is not None and duration_s is not None and at_s > duration_s:
            er.fail("at_s", f"must be within duration_s ({duration_s}); got {at_s}")
        kind = er.str("kind", choices=EVENT_KINDS)
        ev: EventSpec | None = None
        if kind in ("preempt", "fail"):
            node = _event_node(er, known)
            gpus = er.int("gpus", min=1)
            dur = er.num("duration_s", None, min=0.0, exclusive_min=True)
            if node is not None and gpus is not None and gpus > known[node].gpus:
                er.fail("gpus", f"node {node!r} has only {known[node].gpus} GPUs; got {gpus}")
                gpus = None
            if None not in (at_s, node, gpus):
                ev = EventSpec(at_s, kind, node=node, gpus=gpus, duration_s=dur, index=i)
        elif kind in ("restore", "leave"):
            node = _event_node(er, known)
            if node is not None and kind == "leave":
                del known[node]
            if None not in (at_s, node):
                ev = EventSpec(at_s, kind, node=node, index=i)
        elif kind == "join":
            nr = er.obj("node")
            joined = _read_node(nr, gpu_names) if nr is not None else None
            if joined is not None:
                if joined.id in known:
                    er.fail("node", f"node {joined.id!r} is already in the cluster")
                    joined = None
                else:
                    known[joined.id] = joined
            if at_s is not None and joined is not None:
                ev = EventSpec(at_s, kind, node=joined.id, join=joined, index=i)
        elif kind == "degrade_link":
            a = er.str("a")
            b = er.str("b")
            gbps = er.num("gbps", min=0.0, exclusive_min=True)
            dur = er.num("duration_s", None, min=0.0, exclusive_min=True)
            for key, value in (("a", a), ("b", b)):
                if value is not None and value not in known:
                    er.fail(key, f"unknown node {value!r}")
            if a is not None and a == b:
                er.fail("b", "must differ from a")
            if None not in (at_s, a, b, gbps):
                ev = EventSpec(at_s, kind, a=a, b=b, gbps=gbps, duration_s=dur, index=i)
        er.done()
        if ev is not None:
            out.append(ev)
    out.sort(key=lambda e: (e.at_s, e.index))
    return out


MAX_GRACE_S = 300.0  # a yield plus the plan's load must end inside the PREPARE timeout (600 s, transition config)


def _read_jobs(r: ObjectReader, gpu_names: set[str], duration_s: float | None) -> list[Job]:
    """`jobs:` - fine-tune and batch jobs: name, at_s, gpus, gpu (a model, or any), work_gpu_s,
    priority (1), grace_s (30), checkpoint_s (20)."""
    out: list[Job] = []
    jlist = r.list("jobs", [])
    if jlist is None:
        return out
    seen: set[str] = set()
    for jr in jlist.objects():
        name = jr.str("name", max_len=64)
        at_s = jr.num("at_s", 0.0, min=0.0)
        gpus = jr.int("gpus", min=1, max=512)
        gpu = jr.str("gpu", None, max_len=64)
        work = jr.num("work_gpu_s", min=0.0, exclusive_min=True)
        priority = jr.int("priority", JOB_PRIORITY)
        grace = jr.num("grace_s", 30.0, min=0.0, max=MAX_GRACE_S)
        checkpoint = jr.num("checkpoint_s", 20.0, min=0.0)
        jr.done()
        if name is not None and name in seen:
            jr.fail("name", f"duplicate job {name!r}")
            name = None
        elif name is not None:
            seen.add(name)
        if gpu is not None and gpu not in gpu_names:
            jr.fail("gpu", f"unknown GPU {gpu!r}; known: {', '.join(sorted(gpu_names))}")
            continue
        if at_s is not None and duration_s is not None and at_s > duration_s:
            jr.fail("at_s", f"must be within duration_s ({duration_s}); got {at_s}")
            continue
        if None not in (name, at_s, gpus, work, priority, grace, checkpoint):
            out.append(Job(name, gpus, work, gpu, priority, grace, checkpoint, at_s))
    return out


def _event_node(er: ObjectReader, known: dict[str, NodeSpec]) -> str | None:
    node = er.str("node")
    if node is not None and node not in known:
        er.fail("node", f"unknown node {node!r}")
        return None
    return node


def _sort_key(at_s: Any) -> float:
    return float(at_s) if isinstance(at_s, (int, float)) and not isinstance(at_s, bool) else 0.0


def baseline_stage_nodes(baseline: BaselineSpec, free_gpus: dict[str, int]) -> list[str] | None:
    """The node of each pipeline stage of a baseline plan, or None when it does not fit.

    Stages fill the listed nodes in order, as many tp-wide stages per node as its free GPUs
    allow: a TP group never spans two nodes.
    """
    stages: list[str] = []
    for node_id in baseline.nodes:
        fit = free_gpus.get(node_id, 0) // baseline.tp
        stages.extend([node_id] * min(fit, baseline.pp - len(stages)))
        if len(stages) == baseline.pp:
            return stages
    return None
