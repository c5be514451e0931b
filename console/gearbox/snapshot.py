"""The fleet as the scheduler sees it: a `Snapshot` from the stored reports, and load windows.

This is the one place that turns console.fleet's rows into scheduler values:

* `fleet_snapshot(now)` - every present GPU of every node as its agent last reported it
  (healthy, `schedulable` = allocatable, memory used, NVLink group), nodes with their heartbeat
  time, schedulability and engine capabilities, the links and collective curves agents measured
  that are not too old, and the rack defaults the planner assumes elsewhere (console.fleet.links). A GPU never reported yet counts as
  full and last seen at time 0 (out of every block: nothing plans on what nobody has seen).
  Built incrementally: only the nodes whose rows changed since the last snapshot of this
  process are read again (_NodeCache).
* `decision_snapshot(base, deployment, held)` - the same, with every GPU another deployment
  holds (its gear, its running transition's target, its bookings) marked unschedulable, so one
  deployment's decision never plans on another's GPUs - what the operator's paths (override,
  rollout, a manual decision, the emergency) decide on. The control loop's tick shares GPUs by
  memory fraction instead (scheduler/pool/sharing.py, FLEXPIPE_MAX_MODELS_PER_GPU).
* `load_sample(deployment, now)` - one LoadSample from the latest EngineReports of the plans in
  the deployment's routing table: arrivals per second over each node's last report interval,
  prompt and output means weighted by arrivals / finished requests. None when no engine of the
  deployment has reported (silence is not zero load).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection

from console.fleet import links
from console.fleet.models import Gpu, Node
from scheduler.capabilities import EngineCaps
from scheduler.gearbox import LoadSample, LoadWindow
from scheduler.hardware import CATALOG, GpuSpec
from scheduler.plan import Gear
from scheduler.topology import GpuState, NodeState, Snapshot

KEEP_LOAD_S = 3600.0  # how much load history a deployment keeps


@dataclass(frozen=True)
class _Built:
    """One node's part of a snapshot, as built from its rows."""

    key: tuple[object, ...]  # _KEY_FIELDS of the node row it was built from
    node: NodeState
    gpus: tuple[tuple[GpuState, dict[str, Any] | None], ...]  # each present GPU, with its custom spec


# What changes whenever a node's part does: a registration bumps epoch (GPUs listed, moved, re-homed;
# rack, capabilities), a report last_seq (GPU state, reported_at), a heartbeat sweep schedulable.
_KEY_FIELDS = ("node_id", "epoch", "last_seq", "schedulable", "last_seen_at", "reported_at")


class _NodeCache:
    """This process's nodes' parts of the last snapshot (a tick, a gateway's routing pool, the Overview).

    A snapshot used to read every node and GPU row each time: at 1,000 nodes that is 9,000 rows per
    tick and per fleet push (issue 19). Now it reads one narrow row per node (_KEY_FIELDS) and only
    the changed nodes' rows and GPUs. Invariant: an entry's data is at least as new as its key (the
    node row is read before its GPUs), so an unchanged key means nothing of the node changed. Anything
    that moves GPUs between nodes (a registration: a new epoch) or a node joining or leaving rebuilds
    every entry, and so does age (FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S) for writes that bypass the
    actions (the admin). Inside a transaction the rows may be this transaction's own, not committed:
    nothing is cached then.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, _Built] = {}
        self.built_at = float("-inf")
        self.reads = 0  # nodes read (tests, bench)

    def parts(self) -> list[_Built]:
        max_age_s = float(getattr(settings, "FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S", 60.0))
        if max_age_s <= 0 or connection.in_atomic_block:
            return list(_build(None).values())
        keys = {pk: tuple(rest) for pk, *rest in Node.objects.values_list("pk", *_KEY_FIELDS)}
        with self.lock:
            old = self.entries
            whole = (time.monotonic() - self.built_at > max_age_s or keys.keys() != old.keys()
                     or any(old[pk].key[1] != k[1] for pk, k in keys.items()))  # an epoch moved
            if whole:
                self.entries, self.built_at = _build(None), time.monotonic()
                self.reads += len(self.entries)
            else:
                changed = [pk for pk, k in keys.items() if old[pk].key != k]
                if changed:
                    fresh = _build(changed)
                    self.entries = {**old, **fresh}
                    self.reads += len(fresh)
            return sorted(self.entries.values(), key=lambda b: b.node.id)  # node_id: the rows' own order


_cache = _NodeCache()


def _forget_after_fork() -> None:
    global _cache
    _cache = _NodeCache()


os.register_at_fork(after_in_child=_forget_after_fork)


_NODE_FIELDS = ("pk", *_KEY_FIELDS, "rack", "capabilities", "backends")
_GPU_FIELDS = ("node_id", "uuid", "index", "model", "mem_total_bytes", "mem_used_bytes", "sm_util", "temperature_c",
               "healthy", "allocatable", "nvlink_group", "xid_errors", "ecc_errors", "custom_spec")


def _build(pks: list[int] | None) -> dict[int, _Built]:
    """These nodes' parts (None: every node), fresh from their rows: the columns a snapshot reads,
    as plain values (model instances cost the tick most of its time at 8,000 GPUs)."""
    nodes = Node.objects.all() if pks is None else Node.objects.filter(pk__in=pks)
    gpus = Gpu.objects.filter(present=True).order_by("node_id", "index")  # no join for the default ordering
    if pks is not None:
        gpus = gpus.filter(node_id__in=pks)
    node_rows = {n.pk: n for n in nodes.only(*_NODE_FIELDS)}  # before the GPUs: what is built is at least as new as the key
    by_node: dict[int, list[tuple[GpuState, dict[str, Any] | None]]] = {}
    for (node_pk, uuid, index, model, total, used, sm_util, temperature_c, healthy, allocatable, nvlink_group,
         xid_errors, ecc_errors, custom_spec) in gpus.values_list(*_GPU_FIELDS):
        node = node_rows.get(node_pk)
        if node is None:
            continue  # a node that joined after its rows were read: the next snapshot has it
        used = used if used is not None else total
        by_node.setdefault(node_pk, []).append((GpuState(
            uuid=uuid, node_id=node.node_id, index=index, model=model, mem_total_bytes=total,
            mem_used_bytes=min(used, total), sm_util=sm_util or 0.0, temperature_c=temperature_c or 0.0,
            healthy=healthy, schedulable=allocatable, nvlink_group=nvlink_group or None, xid_errors=xid_errors,
            ecc_errors=ecc_errors,
            # every report covers all of its node's GPUs (a delta one lists the changed ones only)
            last_seen_s=node.reported_at.timestamp() if node.reported_at else 0.0), custom_spec))
    return {pk: _Built(key=tuple(getattr(n, f) for f in _KEY_FIELDS),
                       node=NodeState(id=n.node_id, rack=n.rack or n.node_id, schedulable=n.schedulable,
                                      last_seen_s=n.last_seen_at.timestamp() if n.last_seen_at else 0.0,
                                      engine=_engine(n)),
                       gpus=tuple(by_node.get(pk, ()))) for pk, n in node_rows.items()}


def node_parts(*, cached: bool = True) -> list[_Built]:
    """Every node's part as its rows say now, in node_id order (_NodeCache: only the changed nodes
    read again); `cached=False` reads every row. For a caller that wants the GPUs as well as a
    snapshot of them (present.fleet_view): one read for both."""
    return _cache.parts() if cached else list(_build(None).values())


def fleet_snapshot(now: datetime, *, cached: bool = True, parts: list[_Built] | None = None) -> Snapshot:
    """The fleet at `now` (module docstring); `cached=False` reads every row (the reference);
    `parts`: node_parts() the caller read already."""
    parts = node_parts(cached=cached) if parts is None else parts
    customs: dict[str, GpuSpec] = {}
    gpu_states = []
    for part in parts:
        for state, spec in part.gpus:
            if state.model not in CATALOG and spec and state.model not in customs:
                try:
                    customs[state.model] = GpuSpec.from_dict({**spec, "name": state.model})
                except ValueError:
                    continue  # an unusable custom spec: the GPU is left out rather than guessed
            if state.model not in CATALOG and state.model not in customs:
                continue
            gpu_states.append(state)
    known = {p.node.id for p in parts}
    intra, inter = links.defaults()
    snap = Snapshot(now_s=now.timestamp(), nodes=tuple(p.node for p in parts), gpus=tuple(gpu_states),
                    links=links.fresh_links(now, known), intra_rack_gbps=intra, inter_rack_gbps=inter,
                    custom_specs=tuple(customs.values()), collectives=links.fresh_curves(now, known))
    snap.validate()
    return snap


def nodes_read() -> int:
    """Nodes this process's snapshot cache has read from the database so far."""
    return _cache.reads


def _engine(node: Node) -> EngineCaps | None:
    """What the node's engine can run: its active backend's reported capabilities (None: the
    agent reported none - an older agent - and nothing is restricted)."""
    caps = node.capabilities or {}
    backend = node.backends[0] if node.backends else None
    raw = caps.get(backend) if backend else None
    if raw is None:
        return None
    try:
        return EngineCaps.from_dict(raw, f"nodes.{node.node_id}.capabilities")
    except ValueError:
        return None  # stored before a schema change: better unrestricted than a wrong restriction


def gear_gpus(gear: Mapping[str, object] | None) -> set[str]:
    if not gear:
        return set()
    try:
        return set(Gear.from_dict(gear).gpu_uuids)
    except ValueError:
        return set()


def decision_snapshot(base: Snapshot, held_by_others: Iterable[str]) -> Snapshot:
    """`base` with the GPUs other deployments hold marked unschedulable (scheduler.control's)."""
    from scheduler.control import decision_snapshot as marked

    return marked(base, held_by_others)


def load_window(raw: object) -> LoadWindow:
    samples = raw.get("samples", []) if isinstance(raw, dict) else []
    out = []
    for s in samples if isinstance(samples, list) else []:
        # six numbers, or seven with the backlog (requests waiting for admission)
        if isinstance(s, list) and len(s) in (6, 7) and all(isinstance(x, int | float) for x in s):
            backlog = int(s[6]) if len(s) == 7 else 0
            out.append(LoadSample(*[float(x) for x in s[:6]], backlog=max(0, backlog)))
    return LoadWindow(tuple(out))


def load_sample(plan_ids: Iterable[str], now: datetime) -> LoadSample | None:
    """Arrivals per second and request shape of these plans, from their engines' latest reports."""
    wanted = set(plan_ids)
    if not wanted:
        return None
    rate = 0.0
    arrivals = finished = waiting = 0
    prompt_sum = output_sum = 0.0
    seen = False
    for node in Node.objects.exclude(engines=[]):
        reports = [e for e in node.engines if isinstance(e, dict) and e.get("plan_id") in wanted]
        if not reports:
            continue
        seen = True
        interval = _report_interval_s(node)
        for e in reports:
            n = int(e.get("arrivals") or 0)
            f = int(e.get("finished") or 0)
            rate += n / interval
            arrivals += n
            finished += f
            waiting += int(e.get("waiting") or 0)
            prompt_sum += n * float(e.get("prompt_tokens_mean") or 0.0)
            output_sum += f * float(e.get("output_tokens_mean") or 0.0)
    if not seen:
        return None
    prompt = prompt_sum / arrivals if arrivals and prompt_sum else 512.0
    output = output_sum / finished if finished and output_sum else 128.0
    return LoadSample(t_s=now.timestamp(), rate_rps=rate, prompt_tokens_mean=prompt, output_tokens_mean=output,
                      backlog=max(0, waiting))


def _report_interval_s(node: Node) -> float:
    """Seconds between the node's two latest reports (what its `arrivals` counts over)."""
    if node.reported_at is None or node.prev_reported_at is None:
        return float(settings.FLEXPIPE_REPORT_INTERVAL_S)
    return max(0.5, (node.reported_at - node.prev_reported_at).total_seconds())


def report_intervals_s(node_ids: Iterable[str]) -> dict[str, float]:
    """node id -> seconds between its two latest reports (FLEXPIPE_REPORT_INTERVAL_S while it has
    fewer than two; at least 0.5 s), in one query for any number of nodes: what the engines' counts
    of a node's latest report cover. A report repeating its GPUs' state writes no sample, so this
    reads the node's own report times (reported_at, prev_reported_at)."""
    ids = set(node_ids)
    default = float(settings.FLEXPIPE_REPORT_INTERVAL_S)
    out = dict.fromkeys(ids, default)
    for node_id, last, prev in (Node.objects.filter(node_id__in=ids)
                                .values_list("node_id", "reported_at", "prev_reported_at")):
        if last is not None and prev is not None:
            out[node_id] = max(0.5, (last - prev).total_seconds())
    return out


__all__ = ["KEEP_LOAD_S", "decision_snapshot", "fleet_snapshot", "gear_gpus", "load_sample", "load_window",
           "nodes_read", "report_intervals_s"]
