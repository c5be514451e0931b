"""Links between nodes as the console knows them: measured by the agents, aged out, or assumed.

* Agents measure (agents/node/links.py) and report the latest figure per peer with every report;
  `store_links` keeps the latest per (node, peer) - and collective sweeps per (node, op, scope,
  peer, ranks) - refusing what names a node the console does not know.
* `fresh_links(now)` is what the snapshot uses: per node pair the slower of the two directions'
  measurements younger than FLEXPIPE_LINK_MAX_AGE_S (an old figure says nothing about now).
* Where no fresh measurement exists the snapshot falls back to the per-rack default from
  settings (FLEXPIPE_INTRA_RACK_GBPS / FLEXPIPE_INTER_RACK_GBPS); `link_table(now)` lists every
  pair with its source - measured (when, how) or *assumed* - for the Overview page.
* `request_probes(node)` asks a node that just registered to measure its links to every other
  node, and each of those to measure theirs to it (probe_links commands, agents/protocol/).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from agents.protocol import NodeCommandKind, Report
from console.fleet.models import CollectiveCurve, Node, NodeLink
from scheduler.collectives import CollectiveCurve as Curve
from scheduler.topology import LinkState

PROBE = NodeCommandKind.PROBE_LINKS.value


def unknown_peers(report: Report, known: set[str]) -> dict[str, str]:
    """Field path -> reason for every link or collective of `report` naming a node we do not know."""
    out: dict[str, str] = {}
    for i, link in enumerate(report.links):
        if link.peer not in known:
            out[f"links[{i}].peer"] = f"unknown node {link.peer!r}; only registered nodes are peers"
    for i, c in enumerate(report.collectives):
        if c.peer is not None and c.peer not in known:
            out[f"collectives[{i}].peer"] = f"unknown node {c.peer!r}; only registered nodes are peers"
    return out


def _stamp(at: float | None, now: datetime) -> datetime:
    """The agent's measured_at, never later than now (a clock ahead of ours would keep it fresh forever)."""
    if at is None:
        return now
    stamped = datetime.fromtimestamp(at, tz=now.tzinfo)
    return min(stamped, now)


def store_links(node: Node, report: Report, *, now: datetime) -> None:
    """Keep the report's links and collective sweeps (the caller's transaction; peers checked)."""
    for link in report.links:
        NodeLink.objects.update_or_create(node=node, peer=link.peer, defaults={
            "bw_gbps": link.bw_gbps, "latency_us": link.latency_us, "measured_at": _stamp(link.measured_at, now),
            "method": link.method})
    for c in report.collectives:
        CollectiveCurve.objects.update_or_create(
            node=node, op=c.op, scope=c.scope, peer=c.peer or "", ranks=c.ranks,
            defaults={"backend": c.backend, "points": [list(p) for p in c.points],
                      "measured_at": _stamp(c.measured_at, now), "method": c.method})


def _cutoff(now: datetime) -> datetime:
    return now - timedelta(seconds=float(settings.FLEXPIPE_LINK_MAX_AGE_S))


def fresh_links(now: datetime, known: set[str]) -> tuple[LinkState, ...]:
    """Per node pair, the slower direction of the measurements that are not too old."""
    pairs: dict[tuple[str, str], tuple[float, float | None]] = {}
    for link in NodeLink.objects.select_related("node").filter(measured_at__gte=_cutoff(now)):
        a, b = sorted((link.node.node_id, link.peer))
        if a not in known or b not in known or a == b:
            continue
        prev = pairs.get((a, b))
        if prev is None or link.bw_gbps < prev[0]:
            pairs[(a, b)] = (link.bw_gbps, link.latency_us)
    return tuple(LinkState(a, b, bw, lat) for (a, b), (bw, lat) in sorted(pairs.items()))


def fresh_curves(now: datetime, known: set[str]) -> tuple[Curve, ...]:
    """The collective sweeps that are not too old, as the cost model reads them."""
    out = []
    for c in CollectiveCurve.objects.select_related("node").filter(measured_at__gte=_cutoff(now)):
        if c.node.node_id not in known or (c.peer and c.peer not in known):
            continue
        try:
            out.append(Curve(op=c.op, scope=c.scope, node=c.node.node_id, ranks=c.ranks,  # type: ignore[arg-type]
                             points=tuple((int(b), float(t)) for b, t in c.points), peer=c.peer or None,
                             backend=c.backend, measured_at_s=c.measured_at.timestamp(), method=c.method))
        except (TypeError, ValueError):
            continue  # a stored sweep that no longer reads: the physical model instead
    return tuple(out)


def defaults() -> tuple[float, float]:
    """(intra-rack, inter-rack) Gb/s the snapshot assumes where nothing fresh was measured."""
    return float(settings.FLEXPIPE_INTRA_RACK_GBPS), float(settings.FLEXPIPE_INTER_RACK_GBPS)


@dataclass(frozen=True)
class LinkRow:
    """One node pair as the Overview shows it."""

    a: str
    b: str
    bw_gbps: float
    latency_us: float | None
    source: str  # measured | assumed | aged (measured long ago: assumed now)
    measured_at: datetime | None
    method: str


def link_table(now: datetime) -> list[LinkRow]:
    nodes = list(Node.objects.order_by("node_id").values_list("node_id", "rack"))
    racks = {n: r or n for n, r in nodes}
    ids = [n for n, _ in nodes]
    latest: dict[tuple[str, str], NodeLink] = {}
    for link in NodeLink.objects.select_related("node"):
        a, b = sorted((link.node.node_id, link.peer))
        prev = latest.get((a, b))
        if prev is None or link.measured_at > prev.measured_at:
            latest[(a, b)] = link
    intra, inter = defaults()
    cutoff = _cutoff(now)
    fresh = {(ls.a, ls.b): ls for ls in fresh_links(now, set(ids))}
    rows = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            got = fresh.get((a, b))
            last = latest.get((a, b))
            if got is not None and last is not None:
                rows.append(LinkRow(a, b, got.bw_gbps, got.latency_us, "measured", last.measured_at, last.method))
                continue
            assumed = intra if racks[a] == racks[b] else inter
            rows.append(LinkRow(a, b, assumed, None, "aged" if last is not None and last.measured_at < cutoff
                                else "assumed", last.measured_at if last is not None else None,
                                last.method if last is not None else ""))
    return rows


def request_probes(node: Node, *, now: datetime) -> list[str]:
    """Ask `node` to measure its links to every other node with a data address, and each of
    those to measure theirs to it; the command keys carry both registrations' epochs, so asking
    again for the same registrations queues nothing new. Returns the nodes asked."""
    from console.fleet.actions import do_issue_command  # actions calls us at registration

    if not node.data_addr:
        return []
    others = list(Node.objects.exclude(pk=node.pk).exclude(data_addr=""))
    if not others:
        return []
    asked = [node.node_id]
    do_issue_command(node, key=f"probe_links/{node.node_id}@{node.epoch}", kind=PROBE, now=now,
                     payload={"peers": {o.node_id: o.data_addr for o in others}})
    for other in others:
        do_issue_command(other, key=f"probe_links/{other.node_id}@{other.epoch}/{node.node_id}@{node.epoch}",
                         kind=PROBE, now=now, payload={"peers": {node.node_id: node.data_addr}})
        asked.append(other.node_id)
    return asked


@transaction.atomic
def do_request_link_probes(node_ids: Sequence[str] | None = None, *, now: datetime, actor: str) -> list[str]:
    """An operator's 'measure again': every named node (all of them: None) probes every other node
    now. Audited; returns the nodes asked."""
    from console.audit.chain import record
    from console.fleet.actions import do_issue_command

    nodes = list(Node.objects.exclude(data_addr="").order_by("node_id"))
    chosen = [n for n in nodes if node_ids is None or n.node_id in set(node_ids)]
    stamp = now.strftime("%Y%m%dT%H%M%S.%f")
    asked = []
    for n in chosen:
        peers = {o.node_id: o.data_addr for o in nodes if o.pk != n.pk}
        if peers:
            do_issue_command(n, key=f"probe_links/{n.node_id}@{n.epoch}/asked-{stamp}", kind=PROBE, now=now,
                             payload={"peers": peers})
            asked.append(n.node_id)
    record("fleet.links_probe_requested", actor=actor, at=now,
           summary=f"link probe asked of {len(asked)} node(s): {', '.join(asked) or 'none'}", data={"nodes": asked})
    return asked


def known_node_ids(nodes: Iterable[Node]) -> set[str]:
    return {n.node_id for n in nodes}


__all__ = ["LinkRow", "defaults", "do_request_link_probes", "fresh_curves", "fresh_links", "link_table",
           "request_probes", "store_links", "unknown_peers"]
