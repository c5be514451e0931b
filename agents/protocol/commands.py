"""Agent protocol v1's commands: the schema of each kind's payload (`check_payload`) and of its
ok-ack's result (`check_result`), transition and node commands alike; `prepare_shape` reads a
prepare_plan's model_spec and slo (the package docstring says what each command means)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from agents.protocol.rules import (
    _HINT_DIRECTIONS,
    _MAX_HINT_BATCH_SCALE,
    _MAX_HINT_WEIGHT,
    _MAX_PLANS_PER_NODE,
    COMMAND_KINDS,
    MAX_CONTEXT_TOKENS,
    MAX_HINT_TTL_S,
    MAX_WARMUP_TOKENS,
    NODE_ID_RE,
    WEIGHTS_SOURCES,
    NodeCommandKind,
)
from agents.schema import ListReader, ObjectReader, Problems, SchemaError
from scheduler.costmodel import Slo
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan
from scheduler.transition import CommandKind

# -- transition command payloads and ack results (package docstring) ------------------------------
_HEX = frozenset("0123456789abcdef")


def _common(r: ObjectReader) -> None:
    r.str("plan_id", max_len=64)
    r.str("deployment", max_len=64)


def _gpu_map(r: ObjectReader, key: str, *, required: bool = True) -> None:
    raw = r.raw(key) if required else r.raw(key, {})
    if raw is None:
        return
    if not isinstance(raw, dict):
        r.fail(key, "must be an object of GPU uuid -> bytes")
        return
    for uuid, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            r.fail(f"{key}.{uuid}", "must be an integer number of bytes >= 0")


def _strings(r: ObjectReader, key: str) -> None:
    items = r.list(key, [])
    if items is not None:
        for path, item in items.items():
            if not isinstance(item, str):
                r.problems.add(path, "must be a string")


def _model_name(r: ObjectReader, key: str) -> None:
    """A model's name, which an agent turns into a folder of its model store: never a path out of it."""
    name = r.str(key, max_len=128)
    if name is not None and (name.startswith("/") or ".." in name.split("/")):
        r.fail(key, "must be a model name, not a path that leaves the model store")


def _prepare(r: ObjectReader) -> None:
    _common(r)
    plan = r.raw("plan")
    if plan is not None:
        try:
            parsed = Plan.from_dict(plan, "plan")
        except ValueError as exc:
            path, _, reason = str(exc).partition(": ")
            r.problems.add(path, reason or str(exc))
        else:
            pid = r.raw("plan_id", None)
            if isinstance(pid, str) and pid != parsed.plan_id:
                r.fail("plan_id", f"does not match the plan's content ({parsed.plan_id})")
    model = r.raw("model", None)
    _model_name(r, "model")
    sha = r.str("weights_sha256", None, max_len=64)
    if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
        r.fail("weights_sha256", "must be 64 lowercase hex digits or null")
    spec = r.raw("model_spec", None)
    if spec is not None:
        try:
            shape = ModelSpec.from_dict(spec, r.child_path("model_spec"))
        except ValueError as exc:
            path, _, reason = str(exc).partition(": ")
            r.problems.add(path, reason or str(exc))
        else:
            if isinstance(model, str) and shape.name != model:
                r.fail("model_spec.name", f"must be the payload's model {model!r}; got {shape.name!r}")
    slo = r.obj("slo", None)
    if slo is not None:
        slo.num("ttft_ms", min=0.0, exclusive_min=True)
        slo.num("tpot_ms", min=0.0, exclusive_min=True)
        slo.done()
    r.str("role", choices=("leader", "member"))
    stages = r.list("stages", min_len=1, max_len=256)
    if stages is not None:
        for st in stages.objects():
            st.str("pipeline", choices=("main", "prefill", "decode"))
            st.int("index", min=0)
            layers = st.raw("layers")
            if layers is not None and not (isinstance(layers, list) and len(layers) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in layers) and 0 <= layers[0] < layers[1]):
                st.fail("layers", "must be [start, end) with 0 <= start < end")
            st.int("tp", min=1, max=64)
            _strings(st, "gpus")
            ranks = st.list("ranks", min_len=1)
            if ranks is not None:
                for path, item in ranks.items():
                    if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                        st.problems.add(path, "must be an integer rank >= 0")
            st.done()
    _gpu_map(r, "reserve_bytes")
    version = r.obj("model_version", None)
    if version is not None:
        version.int("id", min=1)
        version.str("version", max_len=64)
        version.str("tokenizer", max_len=1024)
        version.int("warmup_tokens", min=0, max=MAX_WARMUP_TOKENS)
        version.int("max_context", None, min=1, max=MAX_CONTEXT_TOKENS)
        version.done()
    peers = r.raw("peers", {})
    if peers is not None and (not isinstance(peers, dict) or not all(isinstance(v, str) for v in peers.values())):
        r.fail("peers", "must be an object of node id -> data address")


def prepare_shape(payload: Mapping[str, Any]) -> tuple[ModelSpec | None, Slo | None]:
    """A prepare_plan payload's optional model_spec and slo (package docstring), as the simulator
    takes them; None for each one it does not carry. Raises ValueError naming the field, for a
    payload that check_payload did not see."""
    raw_spec, raw_slo = payload.get("model_spec"), payload.get("slo")
    spec = ModelSpec.from_dict(raw_spec, "payload.model_spec") if raw_spec is not None else None
    if raw_slo is None:
        return spec, None
    if not isinstance(raw_slo, Mapping) or set(raw_slo) != {"ttft_ms", "tpot_ms"}:
        raise ValueError("payload.slo: must be an object of ttft_ms and tpot_ms")
    values = [raw_slo[k] for k in ("ttft_ms", "tpot_ms")]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite_pos(v) for v in values):
        raise ValueError("payload.slo: ttft_ms and tpot_ms must be finite numbers > 0")
    return spec, Slo(float(values[0]), float(values[1]))


def _finite_pos(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _abort(r: ObjectReader) -> None:
    _common(r)
    r.str("reason", "", max_len=2000, allow_empty=True)
    r.num("drain_timeout_s", 0.0, min=0.0)


def _freeze(r: ObjectReader) -> None:
    _common(r)
    r.int("routing_version", min=0)


def _thaw(r: ObjectReader) -> None:
    _common(r)


def _move(r: ObjectReader) -> None:
    _common(r)
    r.int("routing_version", min=1)
    r.str("boundary", "decode_end", choices=("decode_end",))
    moves = r.list("moves", max_len=100_000)
    if moves is not None:
        for m in moves.objects():
            m.str("seq_id", max_len=200)
            action = m.str("action", choices=("migrate", "replay", "finish"))
            moving = action in ("migrate", "replay")
            for key in ("target_plan", "target_node", "target_addr"):
                value = m.str(key, "", max_len=255, allow_empty=True)
                if moving and key != "target_addr" and not value:
                    m.fail(key, f"is required to {action} a sequence")
            m.num("bw_cap_bytes_per_s", 0.0, min=0.0)
            m.bool("lazy", False)
            m.num("est_stall_s", 0.0, min=0.0)
            m.done()


def _release(r: ObjectReader) -> None:
    _common(r)
    r.num("drain_timeout_s", 0.0, min=0.0)
    fb = r.obj("fallback", None)
    if fb is not None:
        fb.str("target_plan", max_len=64)
        fb.str("target_node", max_len=64)
        fb.str("target_addr", "", max_len=255, allow_empty=True)
        fb.int("routing_version", min=1)
        fb.done()


def _probe_links(r: ObjectReader) -> None:
    peers = r.raw("peers")
    if peers is not None:
        if not isinstance(peers, dict) or not 1 <= len(peers) <= 1024:
            r.fail("peers", "must be an object of 1 to 1024 node id -> data address")
        else:
            for node, addr in peers.items():
                if not isinstance(node, str) or not NODE_ID_RE.match(node):
                    r.problems.add(f"payload.peers.{node}", "must be a node id")
                elif not isinstance(addr, str) or not 1 <= len(addr) <= 255:
                    r.problems.add(f"payload.peers.{node}", "must be a data address (host:port)")
    r.int("bulk_bytes", None, min=1, max=1 << 30)


def _apply_hints(r: ObjectReader) -> None:
    r.str("deployment", max_len=64)
    r.int("hints_version", min=1)
    r.num("ttl_s", min=0.0, max=MAX_HINT_TTL_S, exclusive_min=True)
    plans = r.list("plans", min_len=1, max_len=_MAX_PLANS_PER_NODE)
    if plans is not None:
        seen: set[str] = set()
        for h in plans.objects():
            pid = h.str("plan_id", max_len=64)
            if pid is not None:
                if pid in seen:
                    h.fail("plan_id", f"names plan {pid!r} twice")
                seen.add(pid)
            h.str("direction", choices=_HINT_DIRECTIONS)
            h.num("weight_multiplier", min=0.0, max=_MAX_HINT_WEIGHT, exclusive_min=True)
            h.num("batch_scale", min=0.0, max=_MAX_HINT_BATCH_SCALE, exclusive_min=True)
            h.done()


def _sha256(r: ObjectReader, key: str) -> None:
    sha = r.str(key, max_len=64)
    if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
        r.fail(key, "must be 64 lowercase hex digits")


def _verify(r: ObjectReader) -> None:
    r.int("model_version_id", min=1)
    _model_name(r, "name")
    r.str("version", max_len=64)
    r.str("weights_uri", max_len=1024)
    _sha256(r, "sha256")
    r.str("engine", choices=("vllm", "torch"))
    r.str("tokenizer", max_len=1024)


_PAYLOADS = {
    CommandKind.PREPARE_PLAN.value: _prepare,
    CommandKind.ABORT_PLAN.value: _abort,
    CommandKind.FREEZE_PLAN.value: _freeze,
    CommandKind.THAW_PLAN.value: _thaw,
    CommandKind.MOVE_SEQUENCES.value: _move,
    CommandKind.RELEASE_PLAN.value: _release,
    NodeCommandKind.VERIFY_WEIGHTS.value: _verify,
    NodeCommandKind.PROBE_LINKS.value: _probe_links,
    NodeCommandKind.APPLY_HINTS.value: _apply_hints,
}


def check_payload(kind: str, payload: Any) -> dict[str, Any]:
    """Validate a command's payload; SchemaError names every bad field ("payload.moves[2].action")."""
    if kind not in _PAYLOADS:
        raise SchemaError({"kind": f"must be one of {', '.join(COMMAND_KINDS)}; got {kind!r}"}, "command")
    problems = Problems()
    r = ObjectReader(payload, "payload", problems)
    if r.ok:
        _PAYLOADS[kind](r)
        r.done()
    problems.raise_if_any(f"{kind} payload")
    return dict(payload)


def _seq_list(items: ListReader) -> None:
    for s in items.objects():
        s.str("seq_id", max_len=200)
        s.int("context_tokens", min=0)
        s.int("generated_tokens", min=0)
        s.int("max_tokens", min=0)
        s.str("state", choices=("running", "waiting"))
        s.bool("kv_lost", False)
        s.done()


def check_result(kind: str, result: Any) -> dict[str, Any]:
    """Validate the result of an ok-ack to a command (package docstring: what each says).
    Keys beyond those documented are allowed (an engine may say more); documented ones must be right."""
    if kind not in _PAYLOADS:
        raise SchemaError({"kind": f"must be one of {', '.join(COMMAND_KINDS)}; got {kind!r}"}, "command")
    problems = Problems()
    r = ObjectReader(result, "result", problems)
    if not r.ok:
        problems.raise_if_any(f"{kind} result")
    if kind == CommandKind.FREEZE_PLAN.value:
        seqs = r.list("sequences", [])
        if seqs is not None:
            _seq_list(seqs)
        r.num("decode_step_s", None, min=0.0)
    elif kind == CommandKind.MOVE_SEQUENCES.value:
        moved = r.list("moved", [])
        if moved is not None:
            for m in moved.objects():
                m.str("seq_id", max_len=200)
                m.str("action", choices=("migrate", "replay", "finish"))
                m.bool("ok", True)
                for key in ("kv_bytes", "replay_tokens", "context_tokens"):
                    m.int(key, 0, min=0)
                m.num("stall_s", 0.0, min=0.0)
    elif kind == CommandKind.PREPARE_PLAN.value:
        _gpu_map(r, "reserved_bytes", required=False)
        r.num("load_s", 0.0, min=0.0)
        sha = r.str("weights_sha256", None, max_len=64)
        if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
            r.fail("weights_sha256", "must be 64 lowercase hex digits")
        r.str("weights_source", None, choices=WEIGHTS_SOURCES)
        r.int("weights_bytes", 0, min=0)
    elif kind == NodeCommandKind.VERIFY_WEIGHTS.value:
        _sha256(r, "sha256")
    elif kind == NodeCommandKind.APPLY_HINTS.value:
        r.bool("applied")
        r.int("hints_version", min=0)
        _strings(r, "plans")
        _strings(r, "unknown")
    elif kind == NodeCommandKind.PROBE_LINKS.value:
        links = r.list("links", [])
        if links is not None:
            for lk in links.objects():
                lk.str("peer", max_len=64)
                lk.num("bw_gbps", min=0.0)
                lk.num("latency_us", None, min=0.0)
                lk.num("measured_at", None, min=0.0)
                lk.str("method", "", max_len=64, allow_empty=True)
    problems.raise_if_any(f"{kind} result")
    return dict(result)
