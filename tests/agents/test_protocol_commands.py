"""The transition commands of agent protocol v1: what the executor sends validates, bad payloads name the field."""

from __future__ import annotations

from typing import Any

import pytest

from agents.protocol import (
    COMMAND_KINDS,
    NODE_KINDS,
    TRANSITION_KINDS,
    SchemaError,
    check_payload,
    check_result,
    prepare_shape,
)
from scheduler.transition import CommandKind, Step
from tests.scheduler.transition_world import DEP, GEAR_A, GEAR_B, Load, World


def commands_of_a_run(rollback: bool) -> list[tuple[str, dict[str, object], Step]]:
    from agents.sim.faults import Fault

    w = World()
    w.seed_gear(DEP, GEAR_A)
    w.load[DEP] = Load()
    w.run(3.0)
    if rollback:
        w.fleet.inject(Fault(node="a1", kind="move_sequences", action="fail", times=3))
    w.start(DEP, GEAR_B)
    w.drive(DEP)
    return [(q.command.kind.value, q.command.payload, q.command.step) for q in w.mw.agents.queued.values()]


def test_every_kind_is_documented_and_has_a_schema() -> None:
    import agents.protocol as protocol

    assert set(TRANSITION_KINDS) == {k.value for k in CommandKind}  # the scheduler's, and only those
    assert set(NODE_KINDS) == {"verify_weights", "probe_links", "apply_hints"}
    assert not set(NODE_KINDS) & set(TRANSITION_KINDS)
    assert COMMAND_KINDS == TRANSITION_KINDS + NODE_KINDS
    for kind in COMMAND_KINDS:
        assert f"`{kind}`" in (protocol.__doc__ or "")


@pytest.mark.parametrize("rollback", [False, True], ids=["forward", "rollback"])
def test_every_command_a_transition_sends_is_valid(rollback: bool) -> None:
    sent = commands_of_a_run(rollback)
    kinds = {k for k, _, _ in sent}
    expected = {"prepare_plan", "freeze_plan", "move_sequences"} | (
        {"thaw_plan", "abort_plan"} if rollback else {"release_plan"})
    assert expected <= kinds
    for kind, payload, _ in sent:
        check_payload(kind, payload)


def test_every_answer_of_the_simulated_agents_is_valid() -> None:
    w = World()
    w.seed_gear(DEP, GEAR_A)
    w.load[DEP] = Load()
    w.run(3.0)
    w.start(DEP, GEAR_B)
    w.drive(DEP)
    answered = [(q.command.kind.value, q.result) for q in w.mw.agents.queued.values() if q.result is not None]
    assert answered
    for kind, res in answered:
        assert res is not None and res.status == "ok"
        check_result(kind, res.result)


def a_move() -> dict[str, object]:
    return {"plan_id": "p-1", "deployment": "chat", "routing_version": 4, "boundary": "decode_end",
            "moves": [{"seq_id": "s1", "action": "migrate", "target_plan": "p-2", "target_node": "b1",
                       "target_addr": "b1:7070", "bw_cap_bytes_per_s": 1e9, "lazy": False, "est_stall_s": 0.1}]}


def test_a_bad_payload_is_refused_naming_each_field() -> None:
    bad = a_move()
    bad["moves"][0]["action"] = "teleport"  # type: ignore[index]
    bad["routing_version"] = 0
    bad["extra"] = 1
    with pytest.raises(SchemaError) as exc:
        check_payload("move_sequences", bad)
    assert set(exc.value.errors) == {"payload.moves[0].action", "payload.routing_version", "payload.extra"}


def test_a_move_without_a_target_is_refused() -> None:
    bad = a_move()
    bad["moves"][0]["target_node"] = ""  # type: ignore[index]
    with pytest.raises(SchemaError, match="target_node"):
        check_payload("move_sequences", bad)
    ok = a_move()
    ok["moves"][0] = {"seq_id": "s2", "action": "finish"}  # type: ignore[index]
    check_payload("move_sequences", ok)


def test_a_prepare_whose_plan_id_does_not_match_its_plan_is_refused() -> None:
    sent = [p for k, p, _ in commands_of_a_run(False) if k == "prepare_plan"]
    payload = dict(sent[0])
    payload["plan_id"] = GEAR_A.plans[0].plan_id
    with pytest.raises(SchemaError, match="payload.plan_id"):
        check_payload("prepare_plan", payload)
    payload = dict(sent[0])
    payload["weights_sha256"] = "not-hex"
    with pytest.raises(SchemaError, match="weights_sha256"):
        check_payload("prepare_plan", payload)
    for name in ("../../etc", "/etc"):  # an agent makes the model's name a folder of its model store
        with pytest.raises(SchemaError, match="payload.model"):
            check_payload("prepare_plan", {**sent[0], "model": name})


def test_an_unknown_kind_and_a_bad_result_are_refused() -> None:
    with pytest.raises(SchemaError, match="kind"):
        check_payload("reboot", {})
    with pytest.raises(SchemaError, match=r"result.sequences\[0\].context_tokens"):
        check_result("freeze_plan", {"sequences": [{"seq_id": "s", "context_tokens": -1, "generated_tokens": 0,
                                                    "max_tokens": 1, "state": "running"}]})


def a_verify() -> dict[str, object]:
    """A verify_weights payload as console/registry/actions.py do_request_weights_check writes it."""
    return {"model_version_id": 3, "name": "tiny-llama", "version": "v1", "weights_uri": "hf://org/tiny/model.safetensors",
            "sha256": "ab" * 32, "engine": "torch", "tokenizer": "hf://org/tiny/tokenizer.json"}


def test_a_verify_weights_command_and_its_answer_validate() -> None:
    assert check_payload("verify_weights", a_verify()) == a_verify()
    assert check_result("verify_weights", {"sha256": "cd" * 32}) == {"sha256": "cd" * 32}


@pytest.mark.parametrize(("change", "field"), [
    ({"model_version_id": 0}, "payload.model_version_id"),
    ({"sha256": "AB" * 32}, "payload.sha256"),
    ({"sha256": "ab"}, "payload.sha256"),
    ({"engine": "sim"}, "payload.engine"),
    ({"name": "../../etc"}, "payload.name"),
    ({"name": "/etc/passwd"}, "payload.name"),
    ({"weights_uri": None}, "payload.weights_uri"),
    ({"extra": 1}, "payload.extra"),
])
def test_a_bad_verify_weights_payload_is_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(SchemaError) as refused:
        check_payload("verify_weights", {**a_verify(), **change})
    assert field in refused.value.errors, refused.value.errors


def test_a_missing_verify_weights_field_is_named() -> None:
    payload = a_verify()
    del payload["tokenizer"]
    with pytest.raises(SchemaError) as refused:
        check_payload("verify_weights", payload)
    assert "payload.tokenizer" in refused.value.errors


@pytest.mark.parametrize("result", [{}, {"sha256": "not-hex"}, {"sha256": "AB" * 32}, {"sha256": 7}])
def test_a_verify_weights_answer_without_a_lowercase_digest_is_refused_naming_sha256(result: dict[str, object]
                                                                                     ) -> None:
    with pytest.raises(SchemaError) as refused:
        check_result("verify_weights", result)
    assert "result.sha256" in refused.value.errors, refused.value.errors


def test_a_prepare_may_name_the_version_it_loads_and_each_bad_field_of_it_is_named() -> None:
    sent = dict(next(p for k, p, _ in commands_of_a_run(False) if k == "prepare_plan"))
    version = {"id": 7, "version": "v2", "tokenizer": "/models/llama/tokenizer.json", "warmup_tokens": 16}
    check_payload("prepare_plan", {**sent, "model_version": version})
    check_payload("prepare_plan", {**sent, "model_version": {**version, "max_context": 8192}})
    for bad, field in (({**version, "id": 0}, "model_version.id"), ({**version, "tokenizer": ""}, "model_version.tokenizer"),
                       ({**version, "colour": 1}, "model_version.colour"), ("v2", "model_version"),
                       ({**version, "max_context": 0}, "model_version.max_context"),
                       ({**version, "max_context": "8k"}, "model_version.max_context")):
        with pytest.raises(SchemaError, match=field.replace(".", r"\.")):
            check_payload("prepare_plan", {**sent, "model_version": bad})


@pytest.mark.parametrize("payload,field", [
    ({}, "payload.peers"),
    ({"peers": {}}, "payload.peers"),
    ({"peers": {"has space": "h:1"}}, "payload.peers.has space"),
    ({"peers": {"b1": ""}}, "payload.peers.b1"),
    ({"peers": {"b1": "h:1"}, "bulk_bytes": 0}, "payload.bulk_bytes"),
])
def test_a_bad_probe_links_payload_names_the_field(payload: dict[str, object], field: str) -> None:
    with pytest.raises(SchemaError) as err:
        check_payload("probe_links", payload)
    assert field in err.value.errors, err.value.errors
    check_payload("probe_links", {"peers": {"b1": "10.0.0.2:7070"}, "bulk_bytes": 1 << 20})


HINT = {"plan_id": "p-1", "direction": "speed_up", "weight_multiplier": 0.8, "batch_scale": 0.5}
HINTS = {"deployment": "chat", "hints_version": 3, "ttl_s": 5.0, "plans": [HINT]}


@pytest.mark.parametrize("change,field", [
    ({"hints_version": 0}, "payload.hints_version"),
    ({"hints_version": "3"}, "payload.hints_version"),
    ({"ttl_s": 0}, "payload.ttl_s"),
    ({"ttl_s": 7200}, "payload.ttl_s"),
    ({"deployment": ""}, "payload.deployment"),
    ({"plans": []}, "payload.plans"),
    ({"plans": [{**HINT, "direction": "faster"}]}, "payload.plans[0].direction"),
    ({"plans": [{**HINT, "weight_multiplier": 0}]}, "payload.plans[0].weight_multiplier"),
    ({"plans": [{**HINT, "weight_multiplier": 11}]}, "payload.plans[0].weight_multiplier"),
    ({"plans": [{**HINT, "batch_scale": 0}]}, "payload.plans[0].batch_scale"),
    ({"plans": [{**HINT, "batch_scale": 17}]}, "payload.plans[0].batch_scale"),
    ({"plans": [{**HINT, "batch_scale": "0.5"}]}, "payload.plans[0].batch_scale"),
    ({"plans": [HINT, HINT]}, "payload.plans[1].plan_id"),
    ({"plans": [{**HINT, "priority": 1}]}, "payload.plans[0].priority"),
])
def test_a_bad_apply_hints_payload_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(SchemaError) as err:
        check_payload("apply_hints", {**HINTS, **change})
    assert field in err.value.errors, err.value.errors
    check_payload("apply_hints", HINTS)


def test_an_apply_hints_ack_result_is_checked() -> None:
    check_result("apply_hints", {"applied": True, "hints_version": 3, "plans": ["p-1"], "unknown": []})
    with pytest.raises(SchemaError) as err:
        check_result("apply_hints", {"applied": "yes", "hints_version": 3, "plans": [1]})
    assert {"result.applied", "result.plans[0]"} <= set(err.value.errors), err.value.errors


def test_a_prepare_carries_the_model_spec_it_was_sized_with_and_a_payload_without_it_still_validates() -> None:
    from scheduler.modelspec import ModelSpec, model_spec

    sent = dict(next(p for k, p, _ in commands_of_a_run(False) if k == "prepare_plan"))
    assert ModelSpec.from_dict(sent["model_spec"]) == model_spec(str(sent["model"]))  # what reserve_bytes came from
    spec, slo = prepare_shape(sent)
    assert spec == model_spec(str(sent["model"])) and slo is None  # (the in-memory world knows no SLO)
    old = {k: v for k, v in sent.items() if k not in ("model_spec", "slo")}  # an older console's prepare
    check_payload("prepare_plan", old)
    assert prepare_shape(old) == (None, None)
    check_payload("prepare_plan", {**sent, "slo": {"ttft_ms": 1500, "tpot_ms": 80.5}})


@pytest.mark.parametrize("change,field", [
    (lambda s: s.pop("num_layers"), "payload.model_spec.num_layers"),
    (lambda s: s.update(num_layers=0), "payload.model_spec.num_layers"),
    (lambda s: s.update(hidden_size="4096"), "payload.model_spec.hidden_size"),
    (lambda s: s.update(dtype_bytes=True), "payload.model_spec.dtype_bytes"),
    (lambda s: s.update(num_kv_heads=7), "payload.model_spec.num_kv_heads"),  # must divide num_heads
    (lambda s: s.update(qkv_bias="no"), "payload.model_spec.qkv_bias"),
    (lambda s: s.update(colour=1), "payload.model_spec.colour"),
    (lambda s: s.update(name="Llama-3-70B"), "payload.model_spec.name"),  # not the payload's model
])
def test_a_malformed_model_spec_is_refused_naming_the_field(change: Any, field: str) -> None:
    sent = dict(next(p for k, p, _ in commands_of_a_run(False) if k == "prepare_plan"))
    spec = dict(sent["model_spec"])  # type: ignore[call-overload]
    change(spec)
    with pytest.raises(SchemaError) as exc:
        check_payload("prepare_plan", {**sent, "model_spec": spec})
    assert list(exc.value.errors) == [field]
    if field != "payload.model_spec.name":
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            prepare_shape({**sent, "model_spec": spec})


@pytest.mark.parametrize("slo,field", [
    ({"ttft_ms": 0, "tpot_ms": 80}, "payload.slo.ttft_ms"),
    ({"ttft_ms": 1500}, "payload.slo.tpot_ms"),
    ({"ttft_ms": 1500, "tpot_ms": "fast"}, "payload.slo.tpot_ms"),
    ({"ttft_ms": 1500, "tpot_ms": 80, "p": 99}, "payload.slo.p"),
    ([1500, 80], "payload.slo"),
])
def test_a_malformed_slo_is_refused_naming_the_field(slo: object, field: str) -> None:
    sent = dict(next(p for k, p, _ in commands_of_a_run(False) if k == "prepare_plan"))
    with pytest.raises(SchemaError) as exc:
        check_payload("prepare_plan", {**sent, "slo": slo})
    assert list(exc.value.errors) == [field]
    with pytest.raises(ValueError, match=r"payload\.slo"):
        prepare_shape({**sent, "slo": slo})
