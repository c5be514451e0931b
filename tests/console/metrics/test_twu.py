"""Token-weighted utilisation (scheduler/pool/twu.py) from the engines' reports: in /metrics, in the
Overview heatmap's data and on the deployment page - the same figure, from known token counts."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from console.fleet.models import Node
from console.gearbox import present
from console.gearbox.models import Deployment
from console.gearbox.snapshot import fleet_snapshot
from scheduler.costmodel import PlanProfile, Workload, steady_state
from scheduler.modelspec import model_spec
from tests.console.gearbox.ops import BASELINE, World, engine_report, running_deployment
from tests.console.metrics.test_metrics import scrape
from tests.console.people import Person

pytestmark = pytest.mark.django_db

WINDOW_S = 15.0
PLAN = BASELINE.plans[0]  # TP2 on a1 GPUs 0 and 1


def report(world: World, **changes: float) -> None:
    """One report of a1 whose engine counts cover exactly WINDOW_S (its two latest reports apart)."""
    world.report_engines("a1", replace(engine_report(PLAN.plan_id), **changes))  # type: ignore[arg-type]
    node = Node.objects.get(node_id="a1")
    Node.objects.filter(pk=node.pk).update(prev_reported_at=node.reported_at - timedelta(seconds=WINDOW_S))


def expected_twu(tokens_per_s: float, arrivals: int, prompt_mean: float, output_mean: float) -> float:
    """The docstring's formula, by hand: (c_p x prompt tokens + c_d x output tokens) / window."""
    profile = PlanProfile.build(PLAN, model_spec("Llama-3-8B"), fleet_snapshot(timezone.now()))
    c_p, c_d = steady_state(profile, Workload(0.0, prompt_mean, output_mean)).token_costs_s()
    return (c_p * arrivals * prompt_mean + c_d * tokens_per_s * WINDOW_S) / WINDOW_S


def test_a_report_with_known_token_counts_gives_the_same_twu_in_metrics_and_on_the_pages(viewer: Person) -> None:
    world = running_deployment(moved=False)
    report(world, tokens_per_s=900.0, arrivals=42)  # engine_report: prompts of 410, outputs of 180 tokens
    want = expected_twu(900.0, 42, 410.0, 180.0)
    assert 0.01 < want < 1.0
    m = scrape(viewer.api())
    assert m[("flexpipe_deployment_twu", (("deployment", "chat"),))] == pytest.approx(want, rel=1e-6)
    for uuid in PLAN.gpu_uuids:  # each GPU of the plan carries the plan's TWU
        assert m[("flexpipe_gpu_twu", (("gpu", uuid), ("node", "a1")))] == pytest.approx(want, rel=1e-6)
    assert not [k for k in m if k[0] == "flexpipe_gpu_twu" and ("gpu", PLAN.gpu_uuids[0]) not in k[1]
                and ("gpu", PLAN.gpu_uuids[1]) not in k[1]]

    dep = Deployment.objects.get(name="chat")
    page = present.deployment_state(dep)["deployment"]["twu"]
    assert page["value"] == pytest.approx(want, abs=1e-4)
    assert page["plans"] == [{"plan_id": PLAN.plan_id, "twu": page["value"], "prefill": page["value"],
                              "decode": page["value"]}]
    heatmap = present.overview_state()["gpu_twu"]
    assert set(heatmap) == set(PLAN.gpu_uuids)
    assert all(v == pytest.approx(want, abs=1e-4) for v in heatmap.values())

    # twice the tokens in the same window: twice the TWU; decode tokens weigh more than prompt tokens
    report(world, tokens_per_s=1800.0, arrivals=84)
    twice = scrape(viewer.api())[("flexpipe_deployment_twu", (("deployment", "chat"),))]
    assert twice == pytest.approx(2 * want, rel=1e-6)
    report(world, tokens_per_s=0.0, arrivals=0)
    idle = scrape(viewer.api())
    assert idle[("flexpipe_deployment_twu", (("deployment", "chat"),))] == 0.0


def test_the_pools_twu_and_the_soft_limits_shares_are_in_metrics(viewer: Person, settings: Any) -> None:
    world = running_deployment(moved=False)
    report(world, tokens_per_s=900.0, arrivals=42)
    want = expected_twu(900.0, 42, 410.0, 180.0)
    pool = [g for g in fleet_snapshot(timezone.now()).gpus if g.healthy and g.schedulable]
    m = scrape(viewer.api())
    # the plan's two GPUs at its TWU, every other GPU of the pool free: 0
    assert m[("flexpipe_pool_twu", ())] == pytest.approx(want * 2 / len(pool), rel=1e-6)
    # one model served: all of the admission, its weight unscaled (the pool is far under 0.8)
    assert m[("flexpipe_pool_admission_share", (("model", "Llama-3-8B"),))] == pytest.approx(1.0)
    assert m[("flexpipe_pool_weight_factor", (("model", "Llama-3-8B"),))] == pytest.approx(1.0)
    settings.FLEXPIPE_POOL_MODEL_WEIGHTS = {}  # soft limits off: no shares to show
    off = scrape(viewer.api())
    assert ("flexpipe_pool_twu", ()) in off and not [k for k in off if k[0] == "flexpipe_pool_admission_share"]


def test_without_a_valid_snapshot_the_pool_has_no_twu_and_the_scrape_stands() -> None:
    from types import SimpleNamespace

    from console.gearbox.present_twu import TwuView
    from console.metrics.gearbox import GearboxCollector

    families = {f.name: f for f in GearboxCollector._pool([], TwuView(), SimpleNamespace(snapshot=None))}
    assert set(families) == {"flexpipe_pool_twu", "flexpipe_pool_admission_share", "flexpipe_pool_weight_factor"}
    assert all(not f.samples for f in families.values())


def test_the_loop_reads_the_pool_settings_and_a_bad_one_is_named(settings: Any) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from console.gearbox.control import loop_config
    from console.settings import _model_weights

    settings.FLEXPIPE_POOL_SCALE = {**settings.FLEXPIPE_POOL_SCALE, "high_watermark": 0.9}
    settings.FLEXPIPE_POOL_MODEL_WEIGHTS = {"Llama-3-8B": 2.0}
    config = loop_config()
    assert config.scale.high_watermark == 0.9 and dict(config.model_weights) == {"Llama-3-8B": 2.0}
    settings.FLEXPIPE_POOL_SCALE = {**settings.FLEXPIPE_POOL_SCALE, "high_watermark": 0.3}
    with pytest.raises(ValueError, match="low_watermark/high_watermark"):
        loop_config()
    assert _model_weights("") == {} and _model_weights(" a=1, b=2.5 ") == {"a": 1.0, "b": 2.5}
    for bad in ("a=0", "a=-1", "a=x", "=2", "a", "a=inf"):
        with pytest.raises(ImproperlyConfigured, match="FLEXPIPE_POOL_MODEL_WEIGHTS"):
            _model_weights(bad)


def test_a_plan_without_reports_is_unknown_not_idle(viewer: Person) -> None:
    world = running_deployment(moved=False)
    world.report_engines("a1")  # a report that carries no engine metrics
    dep = Deployment.objects.get(name="chat")
    twu = present.deployment_state(dep)["deployment"]["twu"]
    assert twu == {"value": None, "plans": [{"plan_id": PLAN.plan_id, "twu": None}]}
    assert present.overview_state()["gpu_twu"] == {}
    m = scrape(viewer.api())
    assert not [k for k in m if k[0] in ("flexpipe_deployment_twu", "flexpipe_gpu_twu")]


def test_the_pool_settings_hold_the_seeds_example_and_are_valid() -> None:
    from django.conf import settings

    from scheduler.pool.autoscale import SEED_004_WEIGHTS, ScaleConfig, admission_shares

    config = ScaleConfig.from_dict(settings.FLEXPIPE_POOL_SCALE)
    assert (config.high_watermark, config.low_watermark, config.soft_limit_twu) == (0.85, 0.4, 0.8)
    assert settings.FLEXPIPE_POOL_MODEL_WEIGHTS == SEED_004_WEIGHTS
    shares = admission_shares(settings.FLEXPIPE_POOL_MODEL_WEIGHTS, 1.0, config=config).shares
    assert max(shares, key=shares.__getitem__) == "Qwen2-72B" and min(shares.values()) > 0


def test_report_intervals_are_each_nodes_two_latest_reports_apart(settings: Any) -> None:
    from console.gearbox.snapshot import report_intervals_s
    from tests.console.gearbox.harness import enroll_fleet

    settings.FLEXPIPE_REPORT_INTERVAL_S = 15
    rep = enroll_fleet({"a1": "A", "b1": "B", "c1": "C"}, gpus=2)  # one report each
    rep.report("a1", 2)
    rep.report("b1", 2)
    for node_id, apart_s in (("a1", 7.5), ("b1", 0.1)):
        node = Node.objects.get(node_id=node_id)
        assert node.prev_reported_at is not None  # two reports: the enrolment's and this one
        Node.objects.filter(pk=node.pk).update(prev_reported_at=node.reported_at - timedelta(seconds=apart_s))
    assert report_intervals_s(["a1", "b1", "c1", "nobody"]) == {"a1": 7.5, "b1": 0.5, "c1": 15.0, "nobody": 15.0}


def test_a_report_with_absurd_counts_leaves_the_twu_unknown_and_the_page_up() -> None:
    from console.gearbox.present_twu import twu_view
    from scheduler.plan import Gear, Plan, Stage
    from tests.scheduler.builders import NodeSpec, make_fleet

    snap = make_fleet([NodeSpec("n1", gpus=2)])
    m8 = model_spec("Llama-3-8B")
    plan = Plan(m8.name, "colocated", (Stage(0, m8.num_layers, ("n1-g0",)),), kv_reserve_tokens=100_000)
    dep = Deployment(pk=1, name="x", model_name=m8.name, current_gear=Gear(m8.name, (plan,), (1.0,)).to_dict())
    sane = {"plan_id": plan.plan_id, "node": "n1", "tokens_per_s": 100.0, "arrivals": 10, "prompt_tokens_mean": 500.0}
    broken = {**sane, "arrivals": 10**18, "prompt_tokens_mean": 1e308}
    assert twu_view([dep], {plan.plan_id: [sane]}, snap, {}).deployments[1] is not None
    view = twu_view([dep], {plan.plan_id: [broken]}, snap, {})
    assert view.deployments[1] is None and view.gpus == {}
