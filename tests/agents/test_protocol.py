from __future__ import annotations

import pytest

from agents.protocol import (
    Ack,
    Command,
    EngineReport,
    GpuInfo,
    GpuReport,
    LinkReport,
    RegisterRequest,
    RegisterResponse,
    Report,
    SchemaError,
    parse_ack,
    parse_command,
    parse_register,
    parse_register_response,
    parse_report,
)
from tests.builders import register_body, report_body


def test_every_message_survives_a_round_trip() -> None:
    reg = RegisterRequest("a1", "a1.example", "1.0",
                          (GpuInfo("GPU-1", 0, "H100-SXM", 80 * 2**30, "nvl0"),
                           GpuInfo("GPU-2", 1, "custom", 24 * 2**30, None, {"dense_tflops": 100})),
                          rack="A", backends=("sim", "torch"), data_addr="10.0.0.1:7070")
    assert parse_register(reg.to_dict()) == reg
    resp = RegisterResponse("a1", 3, 15.0, "fpa_x")
    assert parse_register_response(resp.to_dict()) == resp
    rep = Report("a1", 3, 7, (GpuReport("GPU-1", 1, 2, 0.5, 40.0, True, False, 1, 0),),
                 (LinkReport("b1", 100.0),), (EngineReport("p1", 2, 1, 50.0, 0.3, ttft_p95_ms=120.0),))
    assert parse_report(rep.to_dict()) == rep
    cmd = Command(5, "prepare_plan", {"plan": {"id": "x"}}, "chat", 2, "prepare")
    assert parse_command(cmd.to_dict()) == cmd
    ack = Ack("ok", "done", {"kv_bytes": 10})
    assert parse_ack(ack.to_dict()) == ack


def test_it_names_every_bad_field_at_once() -> None:
    body = report_body(seq=0)
    body["gpus"][1]["sm_util"] = 1.5
    body["gpus"][2]["mem_used_bytes"] = "lots"
    body["surprise"] = True
    with pytest.raises(SchemaError) as err:
        parse_report(body)
    assert set(err.value.errors) == {"seq", "gpus[1].sm_util", "gpus[2].mem_used_bytes", "surprise"}
    assert err.value.errors["surprise"] == "unknown key"


def test_it_rejects_another_protocol_version() -> None:
    body = register_body()
    body["protocol"] = 2
    with pytest.raises(SchemaError) as err:
        parse_register(body)
    assert "unsupported version 2" in err.value.errors["protocol"]


@pytest.mark.parametrize("mutate,path", [
    (lambda b: b.pop("gpus"), "gpus"),
    (lambda b: b.update(gpus=[]), "gpus"),
    (lambda b: b["gpus"][1].update(uuid=b["gpus"][0]["uuid"]), "gpus[1].uuid"),
    (lambda b: b["gpus"][1].update(index=0), "gpus[1].index"),
    (lambda b: b.update(node_id="has space"), "node_id"),
    (lambda b: b.update(node_id=None), "node_id"),
    (lambda b: b.update(backends=["cuda-magic"]), "backends[0]"),
    (lambda b: b["gpus"][0].update(mem_total_bytes=-1), "gpus[0].mem_total_bytes"),
])
def test_register_rejections_name_the_field(mutate, path) -> None:  # type: ignore[no-untyped-def]
    body = register_body()
    mutate(body)
    with pytest.raises(SchemaError) as err:
        parse_register(body)
    assert path in err.value.errors


def test_a_report_cannot_claim_more_memory_used_than_the_gpu_has() -> None:
    body = report_body()
    body["gpus"][0]["mem_used_bytes"] = body["gpus"][0]["mem_total_bytes"] + 1
    with pytest.raises(SchemaError) as err:
        parse_report(body)
    assert "must not exceed mem_total_bytes" in err.value.errors["gpus[0].mem_used_bytes"]


def test_a_node_cannot_report_a_link_to_itself() -> None:
    body = report_body()
    body["links"] = [{"peer": "a1", "bw_gbps": 10}]
    with pytest.raises(SchemaError) as err:
        parse_report(body)
    assert "links[0].peer" in err.value.errors


def test_ack_status_must_be_known() -> None:
    with pytest.raises(SchemaError) as err:
        parse_ack({"protocol": 1, "status": "maybe"})
    assert "status" in err.value.errors


def test_capabilities_links_and_collectives_survive_a_round_trip() -> None:
    from agents.protocol import CollectiveReport
    from scheduler.capabilities import VLLM_CAPS

    reg = RegisterRequest("a1", "a1.example", "1.0", (GpuInfo("GPU-1", 0, "H100-SXM", 80 * 2**30, "nvl0"),),
                          backends=("vllm",), capabilities={"vllm": VLLM_CAPS.to_dict()})
    assert parse_register(reg.to_dict()) == reg
    rep = Report("a1", 3, 7, (GpuReport("GPU-1", 1, 2, 0.5, 40.0, True),),
                 (LinkReport("b1", 12.5, 40.0, 1.7e9, "dataplane-bulk"),),
                 collectives=(CollectiveReport("all_reduce", "intra", 8, ((8192, 2e-5), (1 << 20, 9e-5)),
                                               backend="nccl", measured_at=1.7e9, method="torch.distributed"),))
    assert parse_report(rep.to_dict()) == rep


@pytest.mark.parametrize("caps,path", [
    ({"torch": {"backend": "torch"}}, "capabilities.torch"),  # not a backend it runs
    ({"vllm": {"backend": "torch"}}, "capabilities.vllm.backend"),
    ({"vllm": {"backend": "vllm", "modes": ["sideways"]}}, "capabilities.vllm.modes"),
    ({"vllm": {"backend": "vllm", "mem_fraction": 0}}, "capabilities.vllm.mem_fraction"),
    ("all of them", "capabilities"),
])
def test_bad_capabilities_are_refused_naming_the_field(caps: object, path: str) -> None:
    body = {**register_body(), "backends": ["vllm"], "capabilities": caps}
    with pytest.raises(SchemaError) as err:
        parse_register(body)
    assert path in err.value.errors, err.value.errors


@pytest.mark.parametrize("coll,path", [
    ({"op": "all_reduce", "scope": "intra", "ranks": 1, "points": [[8, 1e-5]]}, "collectives[0].ranks"),
    ({"op": "scatter", "scope": "intra", "ranks": 2, "points": [[8, 1e-5]]}, "collectives[0].op"),
    ({"op": "send_recv", "scope": "inter", "ranks": 2, "points": [[8, 1e-5]]}, "collectives[0].peer"),
    ({"op": "send_recv", "scope": "intra", "ranks": 2, "points": [[8, 0]]}, "collectives[0].points[0]"),
    ({"op": "send_recv", "scope": "intra", "ranks": 2, "points": []}, "collectives[0].points"),
])
def test_bad_collective_sweeps_are_refused_naming_the_field(coll: dict[str, object], path: str) -> None:
    body = {**report_body(), "collectives": [coll]}
    with pytest.raises(SchemaError) as err:
        parse_report(body)
    assert path in err.value.errors, err.value.errors


def test_a_report_lists_the_plans_its_agent_runs_and_a_delta_report_carries_them_too() -> None:
    from agents.client import DeltaReports

    gpu = GpuReport("GPU-1", 1, 2, 0.5, 40.0, True)
    rep = Report("a1", 3, 7, (gpu,), plans=("p1", "p2"))
    assert rep.to_dict()["plans"] == ["p1", "p2"] and parse_report(rep.to_dict()) == rep
    assert parse_report({**report_body(), "plans": []}).plans == ()  # it runs nothing: said, not silent
    deltas = DeltaReports()
    deltas.accepted(rep, deltas.shape(rep))
    delta = deltas.shape(Report("a1", 3, 8, (gpu,), plans=("p2",)))
    assert not delta.full and delta.gpus == () and delta.plans == ("p2",)
    assert parse_report(delta.to_dict()) == delta


def test_a_report_without_plans_says_nothing_about_them_as_before() -> None:
    body = report_body()
    assert "plans" not in body and parse_report(body).plans is None  # an older agent
    assert "plans" not in Report("a1", 1, 1, ()).to_dict()  # and one that does not say sends none


@pytest.mark.parametrize("plans,path", [("p-1", "plans"), ([7], "plans[0]"), (["p-1", ""], "plans[1]"),
                                        (["x" * 65], "plans[0]"), ([f"p{i}" for i in range(1025)], "plans")])
def test_a_bad_plans_list_in_a_report_is_refused_naming_the_item(plans: object, path: str) -> None:
    with pytest.raises(SchemaError) as err:
        parse_report({**report_body(), "plans": plans})
    assert set(err.value.errors) == {path}, err.value.errors
