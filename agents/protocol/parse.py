"""Agent protocol v1's message bodies read into agents.protocol.messages: each `parse_*` returns
the message or raises SchemaError naming every bad key (the console reads what agents send, the
agents what the controller answers)."""

from __future__ import annotations

import math
from typing import Any

from agents.protocol.messages import (
    Ack,
    CollectiveReport,
    Command,
    EngineReport,
    GpuInfo,
    GpuReport,
    LinkReport,
    RegisterRequest,
    RegisterResponse,
    Report,
)
from agents.protocol.rules import (
    _MAX_COUNTER,
    _MAX_GPUS_PER_NODE,
    _MAX_LINK_GBPS,
    _MAX_LINKS_PER_REPORT,
    _MAX_MEM_BYTES,
    _MAX_PLANS_PER_NODE,
    _MAX_SEQUENCES_PER_PLAN,
    ACK_STATUSES,
    ENGINE_BACKENDS,
    NODE_ID_RE,
    PROTOCOL_VERSION,
)
from agents.schema import ObjectReader, Problems, read_document
from scheduler.capabilities import EngineCaps

# -- parsing: every function raises SchemaError naming each bad key, or returns the message ----


def _check_protocol(r: ObjectReader) -> None:
    version = r.int("protocol")
    if version is not None and version != PROTOCOL_VERSION:
        r.fail("protocol", f"unsupported version {version}; this controller speaks {PROTOCOL_VERSION}")


def _node_id(r: ObjectReader, key: str = "node_id") -> str | None:
    value = r.str(key, max_len=64)
    if value is not None and not NODE_ID_RE.match(value):
        r.fail(key, "must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")
        return None
    return value


def _plan_ids(r: ObjectReader, problems: Problems) -> list[str] | None:
    """The optional `plans` list of a registration or a report: the plan ids the agent runs."""
    plist = r.list("plans", None, max_len=_MAX_PLANS_PER_NODE)
    if plist is None:
        return None
    plans: list[str] = []
    for path, item in plist.items():
        if not isinstance(item, str) or not 1 <= len(item) <= 64:
            problems.add(path, f"must be a plan id (a string of 1 to 64 characters); got {item!r}")
        else:
            plans.append(item)
    return plans


def parse_register(body: Any) -> RegisterRequest:
    r, problems = read_document(body)
    _check_protocol(r)
    node_id = _node_id(r)
    hostname = r.str("hostname", max_len=255)
    agent_version = r.str("agent_version", max_len=64)
    rack = r.str("rack", None, max_len=64)
    data_addr = r.str("data_addr", None, max_len=255)
    backends: list[str] = []
    blist = r.list("backends", ["sim"], min_len=1, max_len=len(ENGINE_BACKENDS))
    if blist is not None:
        for path, item in blist.items():
            if item not in ENGINE_BACKENDS:
                problems.add(path, f"must be one of {', '.join(ENGINE_BACKENDS)}; got {item!r}")
            else:
                backends.append(item)
    plans = _plan_ids(r, problems)
    capabilities: dict[str, dict[str, Any]] | None = None
    raw_caps = r.raw("capabilities", None)
    if raw_caps is not None:
        if not isinstance(raw_caps, dict):
            r.fail("capabilities", "must be an object of backend name -> capabilities")
        else:
            capabilities = {}
            for name, caps in raw_caps.items():
                where = f"capabilities.{name}"
                if name not in backends:
                    problems.add(where, f"names no backend this agent runs ({', '.join(backends)})")
                    continue
                try:
                    parsed = EngineCaps.from_dict(caps, where)
                except ValueError as exc:
                    path, _, why = str(exc).partition(": ")
                    problems.add(path, why or str(exc))
                    continue
                if parsed.backend != name:
                    problems.add(f"{where}.backend", f"must be {name!r}, the key it is listed under")
                    continue
                capabilities[name] = parsed.to_dict()
    gpus: list[GpuInfo] = []
    seen_uuids: dict[str, str] = {}
    seen_index: dict[int, str] = {}
    glist = r.list("gpus", min_len=1, max_len=_MAX_GPUS_PER_NODE)
    if glist is not None:
        for g in glist.objects():
            uuid = g.str("uuid", max_len=128)
            index = g.int("index", min=0, max=_MAX_GPUS_PER_NODE - 1)
            model = g.str("model", max_len=64)
            mem_total = g.int("mem_total_bytes", min=1, max=_MAX_MEM_BYTES)
            group = g.str("nvlink_group", None, max_len=64)
            custom = g.raw("custom_spec", None)
            if custom is not None and not isinstance(custom, dict):
                g.fail("custom_spec", "must be an object")
                custom = None
            g.done()
            if uuid is not None:
                if uuid in seen_uuids:
                    g.fail("uuid", f"duplicates {seen_uuids[uuid]}")
                seen_uuids.setdefault(uuid, g.child_path("uuid"))
            if index is not None:
                if index in seen_index:
                    g.fail("index", f"duplicates {seen_index[index]}")
                seen_index.setdefault(index, g.child_path("index"))
            if None not in (uuid, index, model, mem_total):
                gpus.append(GpuInfo(uuid, index, model, mem_total, group, custom))
    r.done()
    problems.raise_if_any("register request")
    assert node_id and hostname and agent_version  # noqa: S101 - guaranteed by raise_if_any
    return RegisterRequest(
        node_id=node_id,
        hostname=hostname,
        agent_version=agent_version,
        gpus=tuple(gpus),
        rack=rack,
        backends=tuple(backends),
        data_addr=data_addr,
        plans=None if plans is None else tuple(plans),
        capabilities=capabilities,
    )


def parse_register_response(body: Any) -> RegisterResponse:
    r, problems = read_document(body)
    _check_protocol(r)
    resp = RegisterResponse(
        node_id=r.str("node_id"),
        epoch=r.int("epoch", min=1),
        report_interval_s=r.num("report_interval_s", min=0.0, exclusive_min=True),
        agent_token=r.str("agent_token", None),
    )
    r.done()
    problems.raise_if_any("register response")
    return resp


def parse_report(body: Any) -> Report:
    r, problems = read_document(body)
    _check_protocol(r)
    node_id = _node_id(r)
    epoch = r.int("epoch", min=1)
    seq = r.int("seq", min=1)
    full = r.bool("full", True)
    plans = _plan_ids(r, problems)
    gpus: list[GpuReport] = []
    seen: dict[str, str] = {}
    glist = r.list("gpus", min_len=1 if full is not False else 0, max_len=_MAX_GPUS_PER_NODE)
    if glist is not None:
        for g in glist.objects():
            uuid = g.str("uuid", max_len=128)
            used = g.int("mem_used_bytes", min=0, max=_MAX_MEM_BYTES)
            total = g.int("mem_total_bytes", min=1, max=_MAX_MEM_BYTES)
            sm_util = g.num("sm_util", min=0.0, max=1.0)
            temp = g.num("temperature_c", min=-50.0, max=200.0)
            healthy = g.bool("healthy")
            allocatable = g.bool("allocatable", True)
            xid = g.int("xid_errors", 0, min=0, max=_MAX_COUNTER)
            ecc = g.int("ecc_errors", 0, min=0, max=_MAX_COUNTER)
            g.done()
            if used is not None and total is not None and used > total:
                g.fail("mem_used_bytes", f"must not exceed mem_total_bytes ({total}); got {used}")
                used = None
            if uuid is not None:
                if uuid in seen:
                    g.fail("uuid", f"duplicates {seen[uuid]}")
                seen.setdefault(uuid, g.child_path("uuid"))
            values = (uuid, used, total, sm_util, temp, healthy, allocatable, xid, ecc)
            if None not in values:
                gpus.append(GpuReport(uuid, used, total, sm_util, temp, healthy, allocatable, xid, ecc))
    links: list[LinkReport] = []
    llist = r.list("links", [], max_len=_MAX_LINKS_PER_REPORT)
    if llist is not None:
        for lk in llist.objects():
            peer = _node_id(lk, "peer")
            bw = lk.num("bw_gbps", min=0.0, max=_MAX_LINK_GBPS)
            latency = lk.num("latency_us", None, min=0.0, max=1e8)
            at = lk.num("measured_at", None, min=0.0)
            method = lk.str("method", "", max_len=64, allow_empty=True)
            lk.done()
            if peer is not None and bw is not None:
                if peer == node_id:
                    lk.fail("peer", "must be another node, not the reporting one")
                else:
                    links.append(LinkReport(peer, bw, latency, at, method or ""))
    collectives: list[CollectiveReport] = []
    clist = r.list("collectives", [], max_len=256)
    if clist is not None:
        for c in clist.objects():
            rep = _collective(c, node_id)
            c.done()
            if rep is not None:
                collectives.append(rep)
    engines: list[EngineReport] = []
    elist = r.list("engines", [], max_len=256)
    if elist is not None:
        for e in elist.objects():
            rep = EngineReport(
                plan_id=e.str("plan_id", max_len=128),
                running=e.int("running", min=0, max=_MAX_SEQUENCES_PER_PLAN),
                waiting=e.int("waiting", min=0, max=_MAX_SEQUENCES_PER_PLAN),
                tokens_per_s=e.num("tokens_per_s", min=0.0),
                kv_usage=e.num("kv_usage", min=0.0, max=1.0),
                ttft_p50_ms=e.num("ttft_p50_ms", None, min=0.0),
                ttft_p95_ms=e.num("ttft_p95_ms", None, min=0.0),
                tpot_p50_ms=e.num("tpot_p50_ms", None, min=0.0),
                tpot_p95_ms=e.num("tpot_p95_ms", None, min=0.0),
                finished=e.int("finished", 0, min=0),
                arrivals=e.int("arrivals", 0, min=0),
                prompt_tokens_mean=e.num("prompt_tokens_mean", None, min=0.0),
                output_tokens_mean=e.num("output_tokens_mean", None, min=0.0),
                slo_violations=e.int("slo_violations", 0, min=0),
            )
            e.done()
            if (isinstance(rep.slo_violations, int) and isinstance(rep.finished, int)
                    and rep.slo_violations > rep.finished):
                e.fail("slo_violations", f"must not exceed finished ({rep.finished}); got {rep.slo_violations}")
            engines.append(rep)
    r.done()
    problems.raise_if_any("report")
    assert node_id is not None and epoch is not None and seq is not None  # noqa: S101
    return Report(node_id, epoch, seq, tuple(gpus), tuple(links), tuple(engines), tuple(collectives),
                  full=full is not False, plans=None if plans is None else tuple(plans))


def _collective(c: ObjectReader, node_id: str | None) -> CollectiveReport | None:
    """One `collectives[i]` entry of a report, or None (its problems recorded by name)."""
    op = c.str("op", choices=("all_reduce", "send_recv"))
    scope = c.str("scope", choices=("intra", "inter"))
    ranks = c.int("ranks", min=2, max=4096)
    peer = _node_id(c, "peer") if c.raw("peer", None) is not None else None
    backend = c.str("backend", "", max_len=16, allow_empty=True)
    at = c.num("measured_at", None, min=0.0)
    method = c.str("method", "", max_len=64, allow_empty=True)
    points: list[tuple[int, float]] = []
    plist = c.list("points", min_len=1, max_len=64)
    ok = True
    if plist is not None:
        last = 0
        for path, item in plist.items():
            good = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                    and not isinstance(item[0], bool) and isinstance(item[1], int | float)
                    and not isinstance(item[1], bool) and math.isfinite(item[1]) and item[1] > 0)
            if not good:
                c.problems.add(path, "must be [message bytes (an integer >= 1), seconds (a finite number > 0)]")
                ok = False
                continue
            if item[0] <= last:
                c.problems.add(path, f"sizes must increase and be >= 1; got {item[0]} after {last}")
                ok = False
                continue
            last = item[0]
            points.append((int(item[0]), float(item[1])))
    if scope == "inter" and peer is None:
        c.fail("peer", "is required for an inter-node collective")
        ok = False
    if peer is not None and peer == node_id:
        c.fail("peer", "must be another node, not the reporting one")
        ok = False
    if not ok or None in (op, scope, ranks) or not points:
        return None
    return CollectiveReport(op, scope, ranks, tuple(points), peer, backend or "", at, method or "")


def parse_command(body: Any) -> Command:
    r, problems = read_document(body)
    payload = r.raw("payload", {})
    if not isinstance(payload, dict):
        r.fail("payload", "must be an object")
        payload = {}
    cmd = Command(
        id=r.int("id", min=1),
        kind=r.str("kind", max_len=64),
        payload=payload,
        deployment=r.str("deployment", None),
        transition_seq=r.int("transition_seq", None, min=1),
        step=r.str("step", None),
    )
    r.done()
    problems.raise_if_any("command")
    return cmd


def parse_ack(body: Any) -> Ack:
    r, problems = read_document(body)
    _check_protocol(r)
    status = r.str("status", choices=ACK_STATUSES)
    detail = r.str("detail", "", max_len=2000, allow_empty=True)
    result = r.raw("result", {})
    if not isinstance(result, dict):
        r.fail("result", "must be an object")
        result = {}
    r.done()
    problems.raise_if_any("ack")
    return Ack(status=status, detail=detail, result=result)
