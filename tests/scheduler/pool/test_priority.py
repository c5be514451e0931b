"""Priority across the pool (scheduler/pool/priority.py, loop rule 13): a higher-priority
deployment that cannot stand takes GPUs from a lower one, which yields through its own
transition; both decisions name the other. Pure: the loop stepped by hand, no database."""

from __future__ import annotations

from dataclasses import replace

from scheduler.control import ControlLoop, DeploymentState, FleetState, LoopConfig, Running, Step
from scheduler.gearbox import Deployment, Mode, Outcome, Trigger
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.pool.priority import Holder, choose_givers
from scheduler.topology import Snapshot
from scheduler.transition import Kind
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan
from tests.scheduler.control.test_loop import window

M70 = model_spec("Llama-3-70B")
M7 = model_spec("Llama-2-7B")
NOW = 1000.0
EXCLUSIVE = LoopConfig(max_models_per_gpu=1)  # the 70B could otherwise share the 7B's GPUs by memory


def pool() -> Snapshot:
    # two 8-GPU H100 nodes and a small L40S one a 70B cannot use (140 GB of weights on 2 x 48 GB)
    return make_fleet([NodeSpec("a1"), NodeSpec("a2"), NodeSpec("c1", "L40S", gpus=2, nvlink=False, rack="C")])


def tp(model: str, node: str, n: int, kv: int = 100_000) -> Gear:
    return one_plan_gear(tp_plan(model, [f"{node}-g{i}" for i in range(n)], kv_tokens=kv))


def dep(name: str, model: str, current: Gear, *, rate: float, priority: int, **changes: object) -> DeploymentState:
    spec = model_spec(model)
    d = Deployment(id=name, model=model, slo=CHAT_SLO, baseline=current, priority=priority,
                   mode=changes.pop("mode", Mode.AUTO),  # type: ignore[arg-type]
                   last_switch_times_s=changes.pop("switches", ()))  # type: ignore[arg-type]
    return replace(DeploymentState(deployment=d, current=current, load=window(rate, NOW), model=spec),
                   **changes)  # type: ignore[arg-type]


def step(*states: DeploymentState, config: LoopConfig = EXCLUSIVE, snapshot: Snapshot | None = None) -> dict[str, Step]:
    held = {s.deployment.id: frozenset(s.current.gpu_uuids) for s in states if s.current is not None}
    loop = ControlLoop(config)
    loop.observe(states, FleetState(snapshot=snapshot if snapshot is not None else pool(), held=held))
    return loop.step(NOW).by_id()


def busy() -> DeploymentState:
    # 40 rps of chat on the 70B: more than any gear on one H100 node serves within the SLOs - on
    # the one that serves the most there (an overloaded gear shifts up on its own GPUs first)
    halves = [tp_plan(M70.name, [f"a1-g{i}" for i in range(k, k + 4)], kv_tokens=327_680) for k in (0, 4)]
    return dep("hi", M70.name, Gear(M70.name, tuple(halves), (0.5, 0.5)), rate=40.0, priority=10)


def lower(current: Gear | None = None, switches: tuple[float, ...] = (NOW - 60,), **changes: object) -> DeploymentState:
    # the 7B holds all of a2 (inside its cooldown, so it would not give them back on its own)
    gear = current if current is not None else tp(M7.name, "a2", 8, kv=20_000)
    return dep("lo", M7.name, gear, rate=2.0, priority=1, switches=switches, **changes)


def test_a_priority_10_deployment_takes_gpus_from_a_priority_1_one_which_moves_audited_both_sides() -> None:
    out = step(busy(), lower())
    hi, lo = out["hi"], out["lo"]
    # the taker starts nothing yet: the GPUs are still the giver's; its decision names the giver
    assert hi.start is None and hi.takes is not None and hi.decision is not None
    a2 = {f"a2-g{i}" for i in range(8)}
    assert hi.takes.gpus and hi.takes.gpus <= a2 and [g.giver for g in hi.takes.gives] == ["lo"]
    assert "takes" in hi.decision.reasons[-1] and "deployment lo (priority 1)" in hi.decision.reasons[-1]
    # the giver decides as a topology step without the given GPUs, naming the taker, and moves off them
    assert lo.gives_to == "hi" and lo.trigger is Trigger.TOPOLOGY and lo.decision is not None
    assert lo.decision.reasons[0].startswith(f"gives {len(hi.takes.gpus)} GPU(s)")
    assert "to deployment hi (priority 10 > 1)" in lo.decision.reasons[0]
    assert lo.start is not None and lo.decision.outcome is Outcome.SWITCH
    assert not set(lo.start.target.gpu_uuids) & hi.takes.gpus


def test_once_the_giver_released_them_the_taker_switches_onto_them() -> None:
    first = step(busy(), lower())
    moved = first["lo"].start
    assert moved is not None and first["hi"].takes is not None
    # the giver's transition ran: it holds its new gear only; the taker now finds the GPUs free
    done = lower(current=moved.target, switches=(NOW - 1,))
    later = step(busy(), done)
    start = later["hi"].start
    assert start is not None and later["hi"].takes is None
    assert set(start.target.gpu_uuids) & first["hi"].takes.gpus
    assert later["lo"].gives_to is None


def test_while_the_giver_is_in_a_transition_it_is_not_asked_again() -> None:
    out = step(busy(), lower(running=Running(3, Kind.AUTO, "prepare")))
    assert out["hi"].takes is None and out["lo"].gives_to is None and out["lo"].decision is None


def test_nothing_is_taken_from_an_equal_or_higher_priority_or_a_pinned_one() -> None:
    for other in (lower(deployment=replace(lower().deployment, priority=10)),
                  lower(deployment=replace(lower().deployment, mode=Mode.PINNED))):
        out = step(busy(), other)
        assert out["hi"].takes is None and out["lo"].gives_to is None


def test_a_deployment_that_stands_takes_nothing() -> None:
    out = step(replace(busy(), load=window(3.0, NOW)), lower())
    assert out["hi"].takes is None and out["lo"].gives_to is None


def test_the_rule_can_be_turned_off() -> None:
    out = step(busy(), lower(), config=replace(EXCLUSIVE, take_from_lower=False))
    assert out["hi"].takes is None


def holder(name: str, priority: int, *gpus: str, can_yield: bool = True, kind: str = "deployment") -> Holder:
    return Holder(name, priority, frozenset(gpus), can_yield, kind)


def test_choose_givers_asks_the_lowest_priority_first_and_takes_only_what_the_target_uses() -> None:
    target = tp(M7.name, "x", 2)  # uses x-g0, x-g1
    tried: list[tuple[str, ...]] = []

    def try_with(released: tuple[Holder, ...]) -> Gear | None:
        tried.append(tuple(h.id for h in released))
        return target if any(h.id == "job" for h in released) and len(released) >= 2 else None

    holders = [holder("mid", 5, "y-g0"), holder("job", 1, "x-g0", "x-g1", "x-g2", kind="job"),
               holder("busy", 1, "z-g0", can_yield=False), holder("top", 20, "x-g3"), holder("dep2", 2, "w-g0")]
    got = choose_givers("me", 10, holders, try_with)
    assert tried == [("job",), ("job", "dep2")]  # lowest priority first; cannot-yield and higher ones never
    assert got is not None and [(g.giver, g.gpus, g.kind) for g in got.gives] == [("job", ("x-g0", "x-g1"), "job")]
    assert "from job job (priority 1)" in got.taker_reason()
    assert choose_givers("me", 1, holders, try_with) is None  # nobody below priority 1


def two_nodes() -> Snapshot:
    return make_fleet([NodeSpec("a1"), NodeSpec("a2")])


def test_a_giver_with_nowhere_to_go_unloads_naming_the_taker_and_comes_back_once_gpus_fit_it() -> None:
    # no L40S node: the taker wants all of a2, and nothing is left where the 7B could go
    hi, lo = busy(), lower()
    out = step(hi, lo, snapshot=two_nodes())
    assert out["hi"].takes is not None and out["hi"].takes.gpus == {f"a2-g{i}" for i in range(8)}
    given = out["lo"]
    assert given.gives_to == "hi" and given.start is None and given.release is not None
    assert given.release.startswith("unloads: gives 8 GPU(s)") and "to deployment hi (priority 10 > 1)" in given.release
    # released (at zero, nothing held): the taker switches onto a2; the giver waits for GPUs that fit it
    gone = replace(lo, current=None, at_zero=True, waiting=3)
    later = step(hi, gone, snapshot=two_nodes())
    assert later["hi"].start is not None and later["hi"].takes is None
    assert later["lo"].start is None and later["lo"].release is None
    # GPUs back (a third node): it comes up there, the cold start of a wake-up
    back = step(gone, snapshot=make_fleet([NodeSpec("a1"), NodeSpec("a2"), NodeSpec("a3")]))
    assert back["lo"].start is not None and back["lo"].wake


def test_a_giver_that_can_move_does_not_unload() -> None:
    out = step(busy(), lower())
    assert out["lo"].start is not None and out["lo"].release is None
