"""Learned routing in the gateway (console/gateway/learned.py): per deployment, a cold start on
round-robin, a canary, a rollback when the learned arm does worse - each stage change audited, in
the gauges the alert rule reads, and kept for the Deployment page. The rollout's clock is stepped."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync

from console.audit.models import AuditEntry
from console.gateway import learned, routing
from console.metrics import REGISTRY
from console.metrics.views import register_collectors
from scheduler.router.learned import LearnedRouter
from tests.console.gateway.test_routing import MODEL, gpu_node, route, tp4
from tests.console.gateway.world import make_deployment

# the audit is written by another thread's connection: the test's rows must be committed
serving = pytest.mark.django_db(transaction=True)

ROLLOUT = {"cold_start_s": 10, "window_s": 10, "min_requests": 2, "shares": [0.5, 1.0], "holdback": 0.0,
           "hold_s": 100}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(settings: Any, monkeypatch: pytest.MonkeyPatch, redis_client: Any) -> Iterator[Clock]:
    settings.FLEXPIPE_ROUTER_SEED = 11
    settings.FLEXPIPE_ROUTER_SAMPLE_S = 1e9
    settings.FLEXPIPE_ROUTER_REPORT_TTL_S = 0.0
    settings.FLEXPIPE_ROUTER_FLEET_TTL_S = 0.0
    settings.FLEXPIPE_ROUTER_POLICY = "flexpipe+learned"
    settings.FLEXPIPE_ROUTER_ROLLOUT = ROLLOUT
    c = Clock()
    monkeypatch.setattr(learned, "clock", c)
    monkeypatch.setattr(learned, "soon", joined)  # the audit and Redis written before the next step
    routing.reset()
    redis_client.delete(learned.PREFIX + "chat")
    yield c
    routing.reset()
    redis_client.delete(learned.PREFIX + "chat")


def joined(fn: Any, *args: Any) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


SLO = (1.0, 0.1)  # the deployment's TTFT / TPOT objectives, seconds


def serve(routes: list[dict[str, Any]], n: int, *, learned_violates: bool, seq: list[int]) -> dict[str, int]:
    """`n` requests routed, admitted and finished; the learned arm's miss their TTFT when
    `learned_violates`, round-robin's never do. Returns how many each arm took."""
    arms = {"learned": 0, "rr": 0}
    for _ in range(n):
        seq[0] += 1
        r = async_to_sync(routing.order)("chat", MODEL.name, 1, routes, list(range(300)), 32, outstanding={},
                                         slo_s=SLO)
        policy = r.policy
        assert isinstance(policy, LearnedRouter)
        arm = policy._arm[id(r.decision.request)]
        arms[arm] += 1
        routing.admitted(r, r.candidates[0], f"s{seq[0]}")
        routing.first_token(f"s{seq[0]}")
        routing.done(f"s{seq[0]}", ttft_s=5.0 if learned_violates and arm == "learned" else 0.2, tpot_s=0.01)
    return arms


def gauge(name: str) -> float | None:
    """What /metrics says (from the rollout state every process shares)."""
    register_collectors()
    return REGISTRY.get_sample_value(name, {"deployment": "chat"})


def rollout_entries() -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(event_type=learned.AUDIT_EVENT, deployment="chat").order_by("seq"))


@serving
def test_cold_start_then_a_canary_then_a_rollback_each_audited_with_both_rates(clock: Clock) -> None:
    gpu_node("h1", "H100-SXM")
    gpu_node("a1", "A100-80G")
    routes = [route(tp4("h1"), "h1"), route(tp4("a1"), "a1")]
    make_deployment("chat", routes)
    seq = [0]
    assert serve(routes, 6, learned_violates=True, seq=seq) == {"learned": 0, "rr": 6}  # cold: round-robin only

    clock.t += 10  # the cold start is over: the next request opens the canary at 50%
    arms = serve(routes, 20, learned_violates=True, seq=seq)
    assert arms["learned"] >= 2 and arms["rr"] >= 2
    assert gauge("flexpipe_router_rollout_share") == 0.5
    assert len(rollout_entries()) == 1
    canary = rollout_entries()[0]
    assert "cold -> canary" in canary.summary and canary.actor == "system:gateway"

    clock.t += 10  # the window ends: the learned arm missed every TTFT, round-robin none -> rolled back
    assert serve(routes, 1, learned_violates=True, seq=seq) == {"learned": 0, "rr": 1}
    assert gauge("flexpipe_router_rollback_active") == 1.0
    assert gauge("flexpipe_router_rollout_share") == 0.0
    assert len(rollout_entries()) == 2
    back = rollout_entries()[1]
    assert "canary -> rolled_back" in back.summary
    assert "learned 100.0%" in back.summary and "round-robin 0.0%" in back.summary
    assert len(learned.recent("chat")) == 2
    newest = learned.recent("chat")[0]
    assert newest["after"] == "rolled_back" and newest["learned_violation_rate"] == 1.0
    assert newest["rr_violation_rate"] == 0.0


@serving
def test_a_learned_arm_as_good_as_round_robin_goes_on_to_full(clock: Clock) -> None:
    gpu_node("h1", "H100-SXM")
    routes = [route(tp4("h1"), "h1")]
    make_deployment("chat", routes)
    seq = [0]
    serve(routes, 2, learned_violates=False, seq=seq)
    clock.t += 10
    serve(routes, 20, learned_violates=False, seq=seq)
    clock.t += 10
    serve(routes, 1, learned_violates=False, seq=seq)
    assert gauge("flexpipe_router_rollout_share") == 1.0 and gauge("flexpipe_router_rollback_active") == 0.0
    assert len(rollout_entries()) == 2
    assert "canary -> full" in rollout_entries()[1].summary


@serving
def test_a_request_that_failed_counts_as_a_violation_and_one_the_client_left_counts_as_nothing(
        clock: Clock) -> None:
    gpu_node("h1", "H100-SXM")
    routes = [route(tp4("h1"), "h1")]
    make_deployment("chat", routes)
    r = async_to_sync(routing.order)("chat", MODEL.name, 1, routes, [1, 2, 3], 8, outstanding={}, slo_s=SLO)
    lr = r.policy
    assert isinstance(lr, LearnedRouter)
    routing.admitted(r, r.candidates[0], "gone")
    routing.done("gone")  # nothing observed
    assert lr.controller.window.requests == {"learned": 0, "rr": 0}
    r = async_to_sync(routing.order)("chat", MODEL.name, 1, routes, [1, 2, 3], 8, outstanding={}, slo_s=SLO)
    routing.admitted(r, r.candidates[0], "failed")
    routing.done("failed", ttft_s=float("inf"))
    assert lr.controller.window.requests["rr"] == 1 and lr.controller.window.violations["rr"] == 1


def test_the_default_policy_is_the_shared_router_with_its_configured_weights(settings: Any) -> None:
    settings.FLEXPIPE_ROUTER_POLICY = "flexpipe"
    routing.reset()
    assert routing.policy_for("chat", SLO) is routing.router()
    assert not isinstance(routing.router(), LearnedRouter)


@pytest.mark.parametrize(("raw", "named"), [
    ({"window_s": 0}, "FLEXPIPE_ROUTER_ROLLOUT.window_s: out of range"),
    ({"windows": 3}, "FLEXPIPE_ROUTER_ROLLOUT.windows: unknown field"),
    ({"shares": [0.5, 0.2]}, "FLEXPIPE_ROUTER_ROLLOUT.shares: out of range"),
    ({"min_requests": 2.5}, "FLEXPIPE_ROUTER_ROLLOUT.min_requests: must be a whole number"),
    ({"hold_s": "long"}, "FLEXPIPE_ROUTER_ROLLOUT.hold_s: must be a number"),
    ("{not json", "FLEXPIPE_ROUTER_ROLLOUT: not JSON"),
])
def test_a_bad_rollout_setting_is_refused_naming_the_field(raw: object, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        learned.rollout_config(raw)


def test_an_unknown_policy_is_refused_naming_the_setting(settings: Any) -> None:
    settings.FLEXPIPE_ROUTER_POLICY = "smart"
    with pytest.raises(ValueError, match="FLEXPIPE_ROUTER_POLICY: unknown 'smart'"):
        learned.policy_name()
    assert learned.rollout_config('{"window_s": 60}').window_s == 60.0
