"""The control loop's rules (scheduler/control/loop.py), one named case each; no database."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.backoff import NO_BACKOFF
from scheduler.control import (
    BRING_UP_REASON,
    ControlLoop,
    DeploymentState,
    Finished,
    FirstStage,
    FleetState,
    LoopConfig,
    Running,
    Staged,
)
from scheduler.gearbox import DEFAULT_CONFIG, Deployment, LoadSample, LoadWindow, Mode, Outcome, Trigger
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.topology import Snapshot
from scheduler.transition import Kind, Phase, TransitionRecord
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan, with_gpus

M70 = model_spec("Llama-3-70B")
NOW = 1000.0


def fleet() -> Snapshot:
    return make_fleet([NodeSpec("a1", "H100-SXM"), NodeSpec("a2", "H100-SXM"), NodeSpec("b1", "A100-80G", rack="B")])


def tp8(node: str) -> Gear:
    return one_plan_gear(tp_plan(M70, [f"{node}-g{i}" for i in range(8)], kv_tokens=100_000))


def window(rate: float, now: float = NOW, span: float = 300.0) -> LoadWindow:
    return LoadWindow(tuple(LoadSample(now - span + 15 * i, rate, 512, 200, 0.8, 0.6) for i in range(int(span // 15) + 1)))


def state(name: str = "chat", *, current: Gear | None = None, baseline: Gear | None = None, rate: float = 3.0,
          priority: int = 0, **changes: object) -> DeploymentState:
    dep = Deployment(id=name, model=M70.name, slo=CHAT_SLO, baseline=baseline or tp8("a2"), priority=priority,
                     mode=changes.pop("mode", Mode.AUTO),  # type: ignore[arg-type]
                     last_switch_times_s=changes.pop("switches", ()))  # type: ignore[arg-type]
    base = DeploymentState(deployment=dep, current=current, load=window(rate), model=M70)
    return replace(base, **changes)  # type: ignore[arg-type]


def step(*states: DeploymentState, snap: Snapshot | None = None, trigger: Trigger = Trigger.PERIODIC,
         config: LoopConfig | None = None, held: dict[str, frozenset[str]] | None = None):  # type: ignore[no-untyped-def]
    loop = ControlLoop(config)
    loop.observe(states, FleetState(snapshot=snap or fleet(), held=held or {}))
    return loop.step(NOW, trigger)


def lose(snap: Snapshot, *uuids: str) -> Snapshot:
    return with_gpus(snap, **{u: {"healthy": False} for u in uuids})


def test_rule_1_a_deployment_being_deleted_gets_no_step() -> None:
    assert step(state(current=tp8("a1"), deleting=True)).steps == ()


def test_rule_2_dropped_lost_plans_make_it_a_topology_step() -> None:
    out = step(state(current=tp8("a1"), lost_plans=("p1",)))
    assert out.steps[0].trigger is Trigger.TOPOLOGY
    assert out.steps[0].decision is not None and out.steps[0].decision.trigger is Trigger.TOPOLOGY


def test_rule_3_an_emergency_asks_a_running_transition_to_roll_back_first() -> None:
    running = Running(7, Kind.AUTO, "prepare")
    s = step(state(current=tp8("a1"), emergency_target=tp8("a2"), running=running)).steps[0]
    assert s.emergency and s.abort is not None and s.decision is None
    # its own transition, one already asked, or one past SWITCH is left to end
    for run in (replace(running, kind=Kind.EMERGENCY), replace(running, abort_requested=True),
                replace(running, phase="cleanup")):
        s = step(state(current=tp8("a1"), emergency_target=tp8("a2"), running=run)).steps[0]
        assert s.emergency and s.abort is None and s.decision is None


def test_rule_3_with_nothing_running_the_emergency_starts_its_downshift_before_anything_else() -> None:
    # waiting for reports and a cooldown would hold anything else back
    s = step(state(current=tp8("a1"), emergency_target=tp8("a2"), reports_mirror_last=False,
                   switches=(NOW - 10,))).steps[0]
    assert s.decision is not None and s.decision.trigger is Trigger.EMERGENCY
    assert s.start is not None and s.start.kind is Kind.EMERGENCY and s.start.target == tp8("a2")


def test_rule_4_nothing_is_decided_while_a_transition_runs() -> None:
    s = step(state(current=tp8("a1"), running=Running(3, Kind.AUTO, "switch"))).steps[0]
    assert s.decision is None and s.start is None and s.backoff is None


def test_rule_5_a_finished_transition_is_folded_into_the_back_off() -> None:
    book = NO_BACKOFF.failed(tp8("b1").plans, NOW - 50, "prepare oom", fleet())
    assert book.streak == 1
    done = TransitionRecord("chat", 4, Kind.AUTO, M70.name, tp8("b1"), tp8("a1"), Phase.DONE, NOW - 40)
    s = step(state(current=tp8("a1"), backoff=book, finished=(Finished(done, NOW - 30),))).steps[0]
    assert s.backoff is not None and s.backoff.streak == 0  # a DONE ends the streak


def test_rule_6_it_waits_until_reports_mirror_the_last_transition() -> None:
    out = step(state(current=tp8("a1"), reports_mirror_last=False))
    assert out.waiting == ("chat",) and out.decisions == ()


def test_rule_7_a_done_first_stage_decides_the_second_stage_of_its_kind() -> None:
    staged = Staged(tp8("a2"), Kind.MANUAL, FirstStage.DONE)
    s = step(state(current=tp8("a1"), staged=staged, switches=(NOW - 10,))).steps[0]
    assert s.decision is not None and s.decision.stage == 2
    assert s.start is not None and s.start.kind is Kind.MANUAL and s.start.target == tp8("a2")
    assert s.clear_staged


def test_rule_7_a_first_stage_that_rolled_back_ends_the_path() -> None:
    s = step(state(current=tp8("a1"), staged=Staged(tp8("a2"), Kind.AUTO, FirstStage.ENDED))).steps[0]
    assert s.clear_staged and (s.decision is None or s.decision.stage != 2)


def test_rule_8_a_periodic_step_on_a_gear_that_lost_gpus_is_a_topology_one() -> None:
    s = step(state(current=tp8("a1")), snap=lose(fleet(), "a1-g3")).steps[0]
    assert s.trigger is Trigger.TOPOLOGY and s.decision is not None
    assert s.start is not None and "a1-g3" not in s.start.target.gpu_uuids


def test_rule_9_with_no_gear_the_baseline_comes_up_through_a_relabelled_manual_decision() -> None:
    s = step(state()).steps[0]
    assert s.decision is not None and s.decision.trigger is Trigger.PERIODIC
    assert s.decision.reasons == (BRING_UP_REASON,) and s.start is not None and s.start.target == tp8("a2")
    advisory = step(state(mode=Mode.ADVISORY)).steps[0]
    assert advisory.decision is not None and advisory.decision.outcome is Outcome.ADVISE and advisory.start is None


def test_rule_9_a_baseline_that_does_not_fit_brings_up_the_best_feasible_gear() -> None:
    s = step(state(), snap=lose(fleet(), "a2-g0")).steps[0]
    assert s.decision is not None and s.decision.reasons != (BRING_UP_REASON,)
    assert s.start is not None and "a2-g0" not in s.start.target.gpu_uuids


def test_rule_9_it_waits_for_baseline_gpus_no_agent_reported() -> None:
    snap = with_gpus(fleet(), **{"a2-g1": {"last_seen_s": 0.0}})
    assert step(state(), snap=snap).waiting == ("chat",)


def test_rule_9_a_gear_whose_plans_were_all_dropped_comes_back_as_the_baseline_on_a_topology_step() -> None:
    # its only plan died with GPUs that are back (the driver dropped it: rule 2): no gear is left,
    # and the baseline comes up again - the simulator's driver too (it seeds baselines at t=0 only)
    s = step(state(current=None, lost_plans=("p1",)), config=LoopConfig(skip_cooldown_stays=True)).steps[0]
    assert s.trigger is Trigger.TOPOLOGY and s.decision is not None and s.decision.reasons == (BRING_UP_REASON,)
    assert s.start is not None and s.start.target == tp8("a2")


def test_rule_10_the_cooldown_short_cut_skips_the_call_only_when_asked() -> None:
    st = state(current=tp8("a1"), switches=(NOW - 60,))
    kept = step(st).steps[0]
    assert kept.decision is not None and kept.decision.outcome is Outcome.STAY
    loop = ControlLoop(LoopConfig(skip_cooldown_stays=True))
    loop.observe([st], FleetState(snapshot=fleet()))
    skipped = loop.step(NOW).steps[0]
    assert skipped.decision is None and loop.calls == 0
    assert loop.step(NOW).next_wake_s == NOW - 60 + DEFAULT_CONFIG.cooldown_s
    # not on a topology step, nor when a plan of the gear does not serve
    assert loop.step(NOW, Trigger.TOPOLOGY).steps[0].decision is not None
    loop.observe([replace(st, serving=False)], FleetState(snapshot=fleet()))
    assert loop.step(NOW).steps[0].decision is not None


def test_gpus_started_this_step_are_held_for_the_deployments_decided_after_it() -> None:
    # both want a2's block for their baseline; the higher priority one gets it (exclusive GPUs:
    # sharing them by memory fraction is tests/scheduler/pool/test_sharing.py's)
    first = state("first", priority=5)
    second = state("second", priority=1)
    out = step(second, first, config=LoopConfig(max_models_per_gpu=1)).by_id()
    assert out["first"].start is not None and out["first"].start.target == tp8("a2")
    later = out["second"].start
    assert later is not None and not set(later.target.gpu_uuids) & set(tp8("a2").gpu_uuids)
    assert [s.deployment_id for s in step(second, first, config=LoopConfig(max_models_per_gpu=1)).steps] == [
        "first", "second"]


def test_gpus_another_deployment_holds_are_not_planned_on() -> None:
    s = step(state(), held={"other": frozenset(tp8("a2").gpu_uuids)}).steps[0]
    assert s.start is not None and not set(s.start.target.gpu_uuids) & set(tp8("a2").gpu_uuids)


def test_it_refuses_a_step_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="trigger"):
        step(state(), trigger=Trigger.MANUAL)
    with pytest.raises(ValueError, match="observe"):
        ControlLoop().step(NOW)
    with pytest.raises(ValueError, match="unique"):
        ControlLoop().observe([state(), state()], FleetState(snapshot=fleet()))


def test_the_same_observation_gives_the_same_output() -> None:
    a = step(state("x", priority=2), state("y", current=tp8("a1")))
    b = step(state("x", priority=2), state("y", current=tp8("a1")))
    assert a == b
