"""The console's global correction (console/gearbox/correction.py): engine reports in, apply_hints
commands out to each plan's leader over the agent protocol; bad hints and bad answers are refused
naming the field; the loops' periods are checked at startup (console/gearbox/checks.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agents.protocol import check_payload
from console.fleet.actions import Rejected
from console.fleet.hints import do_send_hints
from console.fleet.models import AgentCommand
from console.gearbox import correction
from console.gearbox.checks import loop_periods
from console.gearbox.models import Deployment
from tests.builders import report_body
from tests.console.conftest import AgentHTTP, enroll

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_loop() -> Any:
    correction.reset()
    yield
    correction.reset()


def deployment(routes: list[dict[str, Any]]) -> Deployment:
    now = timezone.now()
    return Deployment.objects.create(name="chat", model_name="Llama-3-8B", ttft_ms=500.0, tpot_ms=50.0,
                                     baseline_gear={"model": "Llama-3-8B", "plans": [], "weights": []},
                                     routing_version=1, routing=routes, created_at=now, updated_at=now)


def route(plan_id: str, leader: str, *, weight: float = 0.5, frozen: bool = False) -> dict[str, Any]:
    return {"plan_id": plan_id, "weight": weight, "frozen": frozen, "nodes": [leader]}


def report(agent: AgentHTTP, seq: int, *engines: dict[str, Any]) -> None:
    body = report_body(agent.node_id, epoch=agent.epoch, seq=seq)
    body["engines"] = list(engines)
    assert agent.post("/agent/v1/report", body).status_code == 200


def engine(plan_id: str, running: int, waiting: int, **more: Any) -> dict[str, Any]:
    return {"plan_id": plan_id, "running": running, "waiting": waiting, "tokens_per_s": 100.0, "kv_usage": 0.3,
            **more}


def pulled(agent: AgentHTTP) -> list[dict[str, Any]]:
    resp = agent.get("/agent/v1/commands", after=0, wait=0)
    assert resp.status_code == 200
    return [c for c in resp.json()["commands"] if c["kind"] == "apply_hints"]


def test_a_hot_plan_s_leader_is_told_over_the_protocol_and_its_answer_is_checked(client: Client) -> None:
    a, b = enroll(client, "a1"), enroll(client, "b1")
    deployment([route("p-hot", "a1"), route("p-cold", "b1"), route("p-frozen", "b1", frozen=True)])
    report(a, 1, engine("p-hot", 30, 30, finished=40, slo_violations=10))  # 3x+ the load, 25% late
    report(b, 1, engine("p-cold", 8, 0, finished=40), engine("p-frozen", 50, 50))
    sent = correction.correct(now_s=1_000.0)
    assert sent["chat"]["nodes"] == ["a1", "b1"]  # type: ignore[index]
    [cmd] = pulled(a)
    payload = check_payload("apply_hints", cmd["payload"])  # what the agent checks before it acts
    [hint] = payload["plans"]
    assert payload["deployment"] == "chat" and payload["ttl_s"] > 0
    assert hint["plan_id"] == "p-hot" and hint["weight_multiplier"] < 1  # weight moves away from it
    assert hint["direction"] == "speed_up" and hint["batch_scale"] < 1
    [cold] = pulled(b)
    assert [h["plan_id"] for h in cold["payload"]["plans"]] == ["p-cold"]  # a frozen route gets none
    assert cold["payload"]["plans"][0]["weight_multiplier"] > 1
    # an answer that breaks the protocol is refused naming the field, and nothing of it is kept
    bad = a.post(f"/agent/v1/commands/{cmd['id']}/ack",
                 {"protocol": 1, "status": "ok", "result": {"applied": "yes", "hints_version": 1, "plans": [7]}})
    assert bad.status_code == 400 and {"result.applied", "result.plans[0]"} <= set(bad.json()["errors"])
    assert AgentCommand.objects.get(pk=cmd["id"]).state != "ok"
    good = {"applied": True, "hints_version": payload["hints_version"], "plans": ["p-hot"], "unknown": []}
    assert a.post(f"/agent/v1/commands/{cmd['id']}/ack", {"protocol": 1, "status": "ok", "result": good}
                  ).status_code == 200
    assert AgentCommand.objects.get(pk=cmd["id"]).result == good


def test_a_report_s_counts_go_in_once_and_unchanged_hints_are_not_sent_again(client: Client) -> None:
    a, b = enroll(client, "a1"), enroll(client, "b1")
    deployment([route("p1", "a1"), route("p2", "b1")])
    report(a, 1, engine("p1", 10, 0, finished=30, slo_violations=0))
    report(b, 1, engine("p2", 10, 0, finished=30, slo_violations=0))
    correction.correct(now_s=1_000.0)  # first hints: the defaults, sent once
    assert AgentCommand.objects.filter(kind="apply_hints").count() == 2
    correction.correct(now_s=1_000.5)  # same reports, nothing changed, still fresh: nothing new
    assert AgentCommand.objects.filter(kind="apply_hints").count() == 2
    window = correction.loop().windows[("chat", "p1")]
    assert (window.finished, window.violated) == (30, 0)  # not 60: one report, counted once
    report(a, 2, engine("p1", 10, 0, finished=30, slo_violations=9))  # a new report: 9 of 30 late
    correction.correct(now_s=1_001.0)
    assert (window.finished, window.violated) == (60, 9)
    newest = AgentCommand.objects.filter(kind="apply_hints", node__node_id="a1").latest("id")
    assert newest.payload["plans"][0]["direction"] == "speed_up"


def test_a_bad_hint_is_refused_naming_the_field_and_nothing_is_queued(client: Client) -> None:
    enroll(client, "a1"), enroll(client, "b1")
    good = {"plan_id": "p1", "direction": "hold", "weight_multiplier": 1.0, "batch_scale": 1.0}
    with pytest.raises(Rejected) as err:
        do_send_hints("chat", 5, 5.0, {"a1": [good], "b1": [{**good, "batch_scale": 0}], "zz": [good]},
                      now=timezone.now())
    assert err.value.status == 400
    assert set(err.value.errors) == {"nodes.b1.payload.plans[0].batch_scale", "nodes.zz"}
    with pytest.raises(Rejected) as err:
        do_send_hints("chat", 0, 5.0, {"a1": [good]}, now=timezone.now())
    assert set(err.value.errors) == {"payload.hints_version"}
    assert not AgentCommand.objects.filter(kind="apply_hints").exists()
    do_send_hints("chat", 5, 5.0, {"a1": [good]}, now=timezone.now())
    do_send_hints("chat", 5, 5.0, {"a1": [good]}, now=timezone.now())  # the same version again: the same command
    assert AgentCommand.objects.filter(kind="apply_hints").count() == 1


def test_with_no_reports_nothing_is_sent(client: Client) -> None:
    enroll(client, "a1")
    deployment([route("p1", "a1")])
    assert correction.correct(now_s=1.0) == {}
    assert not AgentCommand.objects.filter(kind="apply_hints").exists()


@pytest.mark.parametrize("local,glob,tick,ids", [
    (0.1, 0.5, 15.0, []),
    (0.1, 0.0, 15.0, []),  # the global loop off
    (0.1, 0.6, 15.0, ["flexpipe.W001"]),  # 6x: corollary 4
    (0.5, 0.1, 15.0, ["flexpipe.W001"]),  # global faster than local
    (0.1, 15.0, 15.0, ["flexpipe.E002", "flexpipe.W001"]),  # not under the gear loop
    (0.0, 0.5, 15.0, ["flexpipe.E001"]),
    (0.1, float("nan"), 15.0, ["flexpipe.E001"]),
])
def test_the_loops_periods_are_checked(settings: Any, local: float, glob: float, tick: float, ids: list[str]) -> None:
    settings.FLEXPIPE_LOCAL_LOOP_S, settings.FLEXPIPE_GLOBAL_LOOP_S, settings.FLEXPIPE_TICK_S = local, glob, tick
    got = loop_periods()
    assert [m.id for m in got] == ids, [m.msg for m in got]
    assert all("FLEXPIPE_" in m.msg for m in got)


def test_hint_commands_older_than_any_ttl_are_pruned_by_the_loop(client: Client) -> None:
    from datetime import timedelta

    enroll(client, "a1")
    good = {"plan_id": "p1", "direction": "hold", "weight_multiplier": 1.0, "batch_scale": 1.0}
    do_send_hints("chat", 1, 5.0, {"a1": [good]}, now=timezone.now())
    do_send_hints("chat", 2, 5.0, {"a1": [good]}, now=timezone.now())
    AgentCommand.objects.filter(payload__hints_version=1).update(created_at=timezone.now() - timedelta(hours=2))
    correction.correct(now_s=1_000.0)  # (no deployment: it only prunes)
    assert list(AgentCommand.objects.filter(kind="apply_hints").values_list("payload__hints_version", flat=True)) == [2]


def test_the_global_loop_is_on_beat_every_global_period_and_a_late_run_expires(settings: Any) -> None:
    import os

    from console.gearbox import tasks

    beat = {e["task"]: e for e in settings.CELERY_BEAT_SCHEDULE.values()}
    # seed 003's 100 ms and 500 ms by default
    assert settings.FLEXPIPE_GLOBAL_LOOP_S == float(os.environ.get("FLEXPIPE_GLOBAL_LOOP_S", "0.5"))
    assert settings.FLEXPIPE_LOCAL_LOOP_S == float(os.environ.get("FLEXPIPE_LOCAL_LOOP_S", "0.1"))
    assert beat["gearbox.correct"]["schedule"] == settings.FLEXPIPE_GLOBAL_LOOP_S
    assert beat["gearbox.correct"]["options"]["expires"] == 2 * settings.FLEXPIPE_GLOBAL_LOOP_S

    assert tasks.correct.name == "gearbox.correct"
