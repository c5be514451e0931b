"""Names operators can read: GPUs as `node/index`, gears by shape *and* placement.

A GPU's uuid (`GPU-5c1f...`) says nothing to a person; `h100-a/3` does. A gear's shape alone
(`TP4`) names many gears; its shape with its placement (`TP4 on h100-a/0-3`) names one - two
distinct gears get distinct names unless they differ only in what the eye does not place (the KV
reserve, the routing weights): `distinct()` then adds their content ids. Presentation only:
scheduler/ and the audit log keep the uuids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from scheduler.plan import Gear, Plan, Stage

GpuNames = Mapping[str, str]  # uuid -> "node/index"
_UUID = re.compile(r"GPU-[0-9A-Za-z][0-9A-Za-z-]*[0-9A-Za-z]")
_EPOCH = re.compile(r"\bt=(1[0-9]{9}(?:\.[0-9]+)?) s\b")  # a wall-clock moment in epoch seconds (2001-2286)


def load_names() -> dict[str, str]:
    """Every GPU the fleet has registered, uuid -> node/index (one query)."""
    from console.fleet.models import Gpu

    return {u: f"{n}/{i}" for u, n, i in Gpu.objects.values_list("uuid", "node__node_id", "index")}


def names_from(gpus: Mapping[str, Mapping[str, object]]) -> dict[str, str]:
    """The same from a FleetView's gpus (uuid -> {node, index, ...})."""
    return {u: f"{g['node']}/{g['index']}" for u, g in gpus.items()}


def gpu_name(uuid: str, names: GpuNames) -> str:
    return names.get(uuid) or (uuid if len(uuid) <= 14 else uuid[:12] + "…")


def placement(uuids: Sequence[str], names: GpuNames) -> str:
    """`h100-a/0-3`, `h100-a/0,2 + a100-b/1`: per node, its GPU indices as ranges, in plan order."""
    per_node: dict[str, list[int]] = {}
    loose: list[str] = []
    for u in uuids:
        known = names.get(u)
        node, _, index = known.rpartition("/") if known else ("", "", "")
        if node and index.isdigit():
            per_node.setdefault(node, []).append(int(index))
        else:
            loose.append(gpu_name(u, names))
    parts = [f"{node}/{_ranges(idx)}" for node, idx in per_node.items()]
    return " + ".join(parts + loose)


def _ranges(indices: Iterable[int]) -> str:
    xs = sorted(set(indices))
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _chain(stages: Sequence[Stage]) -> str:
    tps = [s.tp for s in stages]
    if len(stages) == 1:
        return f"TP{tps[0]}"
    if len(set(tps)) == 1:
        return f"PP{len(stages)}×TP{tps[0]}"
    return f"PP{len(stages)} (" + ", ".join(f"TP{t}" for t in tps) + ")"


def plan_label(plan: Plan) -> str:
    """The shape in words: `TP4`, `PP2×TP4`, `PP2 (TP4, TP2)`, `prefill TP2 / decode TP4`."""
    if plan.mode == "disaggregated":
        return f"prefill {_chain(plan.stages)} / decode {_chain(plan.decode_stages)}"
    return _chain(plan.stages)


def plan_name(plan: Plan, names: GpuNames) -> str:
    return f"{plan_label(plan)} on {placement(plan.gpu_uuids, names)}"


def gear_name(gear: Gear, names: GpuNames) -> str:
    """One plan: `TP4 on h100-a/0-3`; several: each, with its share of the requests when unequal."""
    if len(gear.plans) == 1:
        return plan_name(gear.plans[0], names)
    equal = len(set(gear.weights)) == 1
    return " + ".join(plan_name(p, names) + ("" if equal else f" ({w:.0%})")
                      for p, w in zip(gear.plans, gear.weights, strict=True))


def distinct(a: tuple[str, str], b: tuple[str, str]) -> tuple[str, str]:
    """Two (name, gear_id) pairs as two names that differ whenever the gears do."""
    (na, ia), (nb, ib) = a, b
    if na == nb and ia != ib:
        return f"{na} [{ia}]", f"{nb} [{ib}]"
    return na, nb


def readable(text: str, names: GpuNames) -> str:
    """`text` with every GPU uuid it mentions replaced by node/index, and every moment the scheduler
    states in epoch seconds (`until t=1796160332 s`) as a UTC time (reasons, errors)."""
    if "GPU-" in text:
        text = _UUID.sub(lambda m: names.get(m.group(0), m.group(0)), text)
    if "t=" in text:
        text = _EPOCH.sub(lambda m: datetime.fromtimestamp(float(m.group(1)), tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
                          text)
    return text
