"""The transition state machine in memory: the table, the happy path, failures, races, crashes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from agents.sim.faults import Fault
from scheduler.invariants import check
from scheduler.topology import LinkState
from scheduler.transition import (
    ROLLBACK_TABLE,
    STEP_DEFS,
    TABLE,
    CommandKind,
    Kind,
    Phase,
    SeqInfo,
    StaleGuard,
    Step,
    StepState,
    TransitionConfig,
    TransitionRecord,
    crash_points,
    plan_moves,
)
from tests.scheduler.builders import NodeSpec, make_fleet
from tests.scheduler.transition_world import DEP, GEAR_A, GEAR_B, GEAR_C, M8, Crash, Load, World, two_nodes


def busy_world(**kw: object) -> World:
    w = World(**kw)  # type: ignore[arg-type]
    w.seed_gear(DEP, GEAR_A)
    w.load[DEP] = Load()
    w.run(3.0)
    return w


def finish(w: World, rec: TransitionRecord, *, failures: int = 0) -> None:
    """Let every sequence end, then check the invariants; and that no sequence ended in an error
    (invariant 1 allows recorded errors, these tests allow none unless they say so)."""
    w.drain()
    w.assert_clean()
    failed = [e for e in w.log.of("seq_failed")]
    assert len(failed) <= failures, [f"{e.seq_id}: {e.detail}" for e in failed[:5]]
    assert w.fleet.open_sequences() == 0


# --- the table --------------------------------------------------------------------------------
def test_the_table_names_every_step_once_with_its_phase_what_it_does_and_its_undo() -> None:
    steps = [d.step for d in TABLE + ROLLBACK_TABLE]
    assert len(steps) == len(set(steps)) == len(Step)
    assert [d.phase for d in TABLE] == sorted((d.phase for d in TABLE), key=[Phase.PREPARE, Phase.SWITCH,
                                                                               Phase.CLEANUP].index)
    assert all(d.does and d.undo for d in TABLE)
    assert all(d.phase is Phase.ROLLBACK for d in ROLLBACK_TABLE)
    assert len(crash_points()) == 3 * len(TABLE) and len(crash_points(rollback=True)) == 3 * len(ROLLBACK_TABLE)


def test_the_config_refuses_a_bad_value_naming_it() -> None:
    with pytest.raises(ValueError, match="canary_share"):
        TransitionConfig(canary_share=1.5)
    with pytest.raises(ValueError, match="switch_retries"):
        TransitionConfig(switch_retries=-1)


# --- the happy path ---------------------------------------------------------------------------
def test_a_transition_hands_every_sequence_over_and_ends_on_the_target_gear() -> None:
    w = busy_world()
    in_flight = w.fleet.open_sequences()
    assert in_flight > 5
    w.start(DEP, GEAR_B)
    rec = w.drive(DEP)
    assert rec.phase is Phase.DONE and rec.error == ""
    assert [s.step for s in rec.steps] == [d.step for d in TABLE]
    assert all(s.state is StepState.OK for s in rec.steps)
    assert w.store.current_gear(DEP) == GEAR_B
    # routing: canary (both), flip (old frozen), unroute (only the new plan)
    table = w.routing.current(DEP)
    assert [r.plan_id for r in table.routes] == [GEAR_B.plans[0].plan_id] and table.routes[0].weight == 1.0
    commits = [e for e in w.log.of("routing_committed") if e.seq == rec.seq]
    assert [len(e.plans) for e in commits] == [2, 2, 1]
    assert [frozen for _, _, frozen in commits[1].plans] == [False, True]
    # what moved is recorded, and every moved sequence went long-first
    moved = rec.moved
    assert moved.seqs_migrated + moved.seqs_replayed + moved.seqs_finished > 0
    assert moved.seqs_migrated == 0 or moved.kv_bytes_migrated > 0
    # the old plan is released, its bookings dropped; the new one is booked
    assert w.fleet.live_plans() == {GEAR_B.plans[0].plan_id}
    assert set(w.store.booked(DEP)) == {GEAR_B.plans[0].plan_id}
    finish(w, rec)


def test_moves_go_longest_first_and_short_sequences_are_left_to_finish() -> None:
    w = busy_world(config=replace(World().config, drain_budget_s=1.0))
    w.start(DEP, GEAR_C)
    rec = w.drive(DEP)
    move = next(s for s in rec.steps if s.step is Step.MOVE)
    directives = move.intent.commands[0].payload["moves"]
    assert isinstance(directives, list) and directives
    active = [d for d in directives if not d["lazy"]]
    moving = [d for d in active if d["action"] != "finish"]
    ctx = {s["seq_id"]: s["context_tokens"]
           for s in rec.ok_result(Step.FREEZE)["sequences"][GEAR_A.plans[0].plan_id]}  # type: ignore[index]
    assert [ctx[d["seq_id"]] for d in active] == sorted((ctx[d["seq_id"]] for d in active), reverse=True)
    assert moving, "a busy plan has sequences worth moving"
    finish(w, rec)


def test_the_first_transition_brings_a_gear_up_from_nothing() -> None:
    w = World()
    w.start(DEP, GEAR_A)
    rec = w.drive(DEP)
    assert rec.phase is Phase.DONE and rec.from_gear is None
    canary = next(s for s in rec.steps if s.step is Step.CANARY)
    assert canary.intent.noop  # nothing served before: no canary
    assert w.routing.current(DEP).routes[0].plan_id == GEAR_A.plans[0].plan_id
    w.load[DEP] = Load()
    w.run(2.0)
    assert w.fleet.open_sequences() > 0
    finish(w, rec)


def test_a_transition_to_the_gear_it_runs_is_refused_and_nothing_is_created() -> None:
    w = busy_world()
    with pytest.raises(ValueError, match="to_gear"):
        w.executor().start(DEP, GEAR_A)
    assert w.store.active(DEP) is None


# --- crashes ----------------------------------------------------------------------------------
def crash_at(point: str, times: int = 1) -> tuple[list[int], object]:
    hits = [0]

    def probe(p: str) -> None:
        if p == point and hits[0] < times:
            hits[0] += 1
            raise Crash(p)

    return hits, probe


@pytest.mark.parametrize("point", crash_points() + ("prepare.partial", "finish.persisted"))
def test_a_crash_at_any_forward_point_resumes_and_keeps_every_invariant(point: str) -> None:
    w = busy_world(snapshot=None)
    if point == "prepare.partial":  # a plan on two nodes: prepare sends two commands
        two = replace(GEAR_B, plans=(replace(GEAR_B.plans[0], stages=(
            replace(GEAR_B.plans[0].stages[0], layer_end=16, gpu_uuids=("a1-g6",)),
            replace(GEAR_B.plans[0].stages[0], layer_start=16, gpu_uuids=("b1-g0",)))),))
        w.start(DEP, two)
    else:
        w.start(DEP, GEAR_B)
    hits, probe = crash_at(point)
    rec = w.drive(DEP, w.executor(probe=probe), restart=lambda: w.executor())  # type: ignore[arg-type]
    assert hits[0] == 1, f"the transition never passed {point}"
    assert rec.phase is Phase.DONE, rec.error
    assert w.fleet.live_plans() == {p.plan_id for p in w.store.current_gear(DEP).plans}  # type: ignore[union-attr]
    finish(w, rec)


@pytest.mark.parametrize("point", crash_points(rollback=True))
def test_a_crash_at_any_rollback_point_still_rolls_back_and_keeps_every_invariant(point: str) -> None:
    w = busy_world()
    # the move fails three times (the first try and two retries): the transition rolls back
    w.fleet.inject(Fault(node="a1", kind="move_sequences", action="fail", times=3))
    w.start(DEP, GEAR_B)
    hits, probe = crash_at(point)
    rec = w.drive(DEP, w.executor(probe=probe), restart=lambda: w.executor())  # type: ignore[arg-type]
    assert hits[0] == 1, f"the rollback never passed {point}"
    assert rec.phase is Phase.ROLLED_BACK and "move" in rec.error
    assert w.store.current_gear(DEP) == GEAR_A
    assert [r.plan_id for r in w.routing.current(DEP).routes] == [GEAR_A.plans[0].plan_id]
    assert w.fleet.live_plans() == {GEAR_A.plans[0].plan_id}
    assert set(w.store.booked(DEP)) == {GEAR_A.plans[0].plan_id}
    finish(w, rec)


def test_crashing_twice_at_every_point_of_one_transition_still_ends_it() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    seen: dict[str, int] = {}

    def probe(p: str) -> None:
        seen[p] = seen.get(p, 0) + 1
        if seen[p] <= 2:
            raise Crash(p)

    rec = w.drive(DEP, w.executor(probe=probe), restart=lambda: w.executor(probe=probe))
    assert rec.phase is Phase.DONE
    assert w.crashes >= 2 * len(TABLE)
    finish(w, rec)


# --- failures ---------------------------------------------------------------------------------
def test_an_agent_lost_during_prepare_rolls_back_and_frees_what_was_booked() -> None:
    w = busy_world()
    w.fleet.inject(Fault(node="b1", kind="prepare_plan", action="hang"))
    w.start(DEP, GEAR_B)
    w.step()
    w.executor().advance(DEP)
    w.run(0.5)
    w.fleet.lose_node("b1")  # its agent stops answering; the node is no longer schedulable
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK
    assert "prepare" in rec.error and ("preempted" in rec.error or "gone" in rec.error)
    assert w.store.current_gear(DEP) == GEAR_A
    assert set(w.store.booked(DEP)) == {GEAR_A.plans[0].plan_id}
    assert not any(s.step is Step.CANARY for s in rec.steps)  # nothing was ever routed to it
    finish(w, rec)


def test_a_prepare_that_never_answers_times_out_and_rolls_back() -> None:
    w = busy_world()
    w.fleet.inject(Fault(node="b1", kind="prepare_plan", action="hang"))
    w.start(DEP, GEAR_B)
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK and "timed out" in rec.error
    abort = next(s for s in rec.steps if s.step is Step.RB_ABORT)
    assert [c.kind for c in abort.intent.commands] == [CommandKind.ABORT_PLAN]  # safe although it never ran
    assert w.fleet.live_plans() == {GEAR_A.plans[0].plan_id}
    finish(w, rec)


def test_a_preemption_during_switch_is_retried_and_the_transition_completes() -> None:
    w = busy_world()
    new_gpus = list(GEAR_B.plans[0].gpu_uuids)
    w.start(DEP, GEAR_B)
    ex = w.executor()
    while not w.store.active(DEP).done(Step.FLIP):  # type: ignore[union-attr]
        ex.advance(DEP)
        w.step()
    w.fleet.lose_gpus(new_gpus)  # another tenant takes the new plan's GPUs in the middle of SWITCH
    while not any(e.kind == "step_failed" for e in w.log):
        ex.advance(DEP)
        w.step()
    w.fleet.restore_gpus(new_gpus)  # ... and gives them back before the retry
    rec = w.drive(DEP, ex)
    assert rec.phase is Phase.DONE
    failed = [s for s in rec.steps if s.state is StepState.FAILED]
    assert len(failed) == 1 and failed[0].reason == "preempted" and failed[0].phase is Phase.SWITCH
    retry = rec.attempts(failed[0].step)[1]
    assert retry.state is StepState.OK and retry.attempt == 2
    assert [c.kind for c in retry.intent.pre] == [CommandKind.PREPARE_PLAN]  # the shadow plan came back first
    finish(w, rec)


def test_a_preemption_during_switch_that_lasts_is_retried_twice_then_rolled_back() -> None:
    w = busy_world()
    w.fleet.inject(Fault(node="a1", kind="freeze_plan", action="lose_gpus",
                         uuids=tuple(GEAR_B.plans[0].gpu_uuids), taken=True))
    w.start(DEP, GEAR_B)
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK
    failed = [s for s in rec.steps if s.phase is Phase.SWITCH and s.state is StepState.FAILED]
    assert len(failed) == 3 and all(s.reason == "preempted" for s in failed)
    assert w.store.current_gear(DEP) == GEAR_A
    assert [r.plan_id for r in w.routing.current(DEP).routes] == [GEAR_A.plans[0].plan_id]
    finish(w, rec)


def test_sequences_that_reached_the_new_plan_come_back_when_it_rolls_back() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    hits, probe = crash_at("move.effected")  # stop the executor while the move is under way
    ex = w.executor(probe=probe)  # type: ignore[arg-type]
    with pytest.raises(Crash):
        while True:
            ex.advance(DEP)
            w.step()
    w.run(1.0)  # sequences reach GEAR_B; new requests (flip) go there too
    assert w.executor().abort(DEP, "operator: emergency downshift")
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK and "emergency" in rec.error
    back = rec.moved_back
    assert back.seqs_migrated + back.seqs_replayed + back.seqs_finished > 0
    assert w.fleet.live_plans() == {GEAR_A.plans[0].plan_id}
    finish(w, rec)


def test_an_abort_during_cleanup_lets_the_transition_finish_forward() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    ex = w.executor()
    while w.store.active(DEP).phase is not Phase.CLEANUP:  # type: ignore[union-attr]
        ex.advance(DEP)
        w.step()
    assert w.executor().abort(DEP, "too late")
    rec = w.drive(DEP)
    assert rec.phase is Phase.DONE and w.store.current_gear(DEP) == GEAR_B
    finish(w, rec)


def test_a_gpu_booked_by_another_deployment_cannot_be_booked_again_on_exclusive_gpus() -> None:
    w = busy_world()
    w.store.max_models_per_gpu = 1
    w.seed_gear("other", GEAR_C)
    overlap = GEAR_C
    w.start(DEP, overlap)
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK and "booked by deployment other" in rec.error
    assert set(w.store.booked("other")) == {GEAR_C.plans[0].plan_id}
    finish(w, rec)


def test_a_gpu_already_shared_by_max_models_per_gpu_deployments_refuses_a_third() -> None:
    w = busy_world()
    assert w.store.max_models_per_gpu == 2  # seed 004 section 4.2's default
    w.seed_gear("other", GEAR_C)
    w.seed_gear("third", GEAR_C)
    before = w.store.booked(DEP)
    w.start(DEP, GEAR_C)
    rec = w.drive(DEP)
    assert rec.phase is Phase.ROLLED_BACK
    assert "booked by deployments other, third: at most 2 deployments share a GPU" in rec.error
    assert w.store.booked(DEP) == before  # its refused plan booked nothing
    finish(w, rec)


# --- races ------------------------------------------------------------------------------------
def test_two_starts_at_once_make_one_transition() -> None:
    w = busy_world()
    first, second = w.executor(), w.executor()
    a = first.start(DEP, GEAR_B)
    b = second.start(DEP, GEAR_C)
    assert a is not None and b is None
    assert len(w.store.history(DEP)) == 1


def test_two_executors_interleaved_on_one_transition_never_act_twice() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    one, two = w.executor(), w.executor()
    for _ in range(4000):
        rec = w.store.active(DEP)
        if rec is None:
            break
        one.advance(DEP)
        two.advance(DEP)
        w.step()
    assert w.store.active(DEP) is None
    issued = [e for e in w.log.of("command_issued")]
    assert len({(e.seq, e.step, e.attempt, e.node, e.plan_id) for e in issued}) == len(issued)
    finish(w, w.store.history(DEP)[-1])


def test_an_executor_that_woke_up_late_cannot_act_for_a_step_someone_else_finished() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    ex = w.executor()
    ex.advance(DEP)  # reserve, prepare saved and sent
    stale = w.store.active(DEP)
    assert stale is not None
    w.run(3.0)
    ex.advance(DEP)  # the prepare is acked: the record moved on
    cmd = stale.current.intent.commands  # type: ignore[union-attr]
    with pytest.raises(StaleGuard):
        w.mw.agents.send(cmd, stale.guard())
    with pytest.raises(StaleGuard):
        w.mw.store.reserve(stale.guard(), {"p": {"a1-g7": 1}})


def test_a_second_transition_waits_for_the_first_and_gets_a_higher_seq() -> None:
    w = busy_world()
    first = w.start(DEP, GEAR_B)
    assert w.executor().start(DEP, GEAR_C) is None
    w.drive(DEP)
    second = w.start(DEP, GEAR_C)
    assert second.seq == first.seq + 1 and second.from_gear == GEAR_B
    rec = w.drive(DEP)
    assert rec.phase is Phase.DONE
    finish(w, rec)


# --- records ----------------------------------------------------------------------------------
def test_a_record_survives_its_json_round_trip() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    rec = w.drive(DEP)
    again = TransitionRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec


def test_a_bad_record_is_refused_naming_the_field() -> None:
    w = busy_world()
    rec = w.start(DEP, GEAR_B).to_dict()
    rec["seq"] = "one"
    with pytest.raises(ValueError, match="transition.seq"):
        TransitionRecord.from_dict(rec)


def test_every_step_of_a_clean_run_is_audited_in_the_log_before_its_effects() -> None:
    w = busy_world()
    w.start(DEP, GEAR_B)
    rec = w.drive(DEP)
    started = {(e.step, e.attempt) for e in w.log.of("step_started") if e.seq == rec.seq}
    assert {(d.step.value, 1) for d in TABLE} <= started
    assert not check(w.log, complete=False)
    assert STEP_DEFS[Step.FLIP].phase is Phase.SWITCH


def test_kinds_are_kept_on_the_record() -> None:
    w = busy_world()
    rec = w.start(DEP, GEAR_B, kind=Kind.EMERGENCY)
    assert rec.kind is Kind.EMERGENCY


# --- the per-sequence choice ------------------------------------------------------------------
def test_plan_moves_sends_long_sequences_first_and_leaves_short_ones_to_finish() -> None:

    seqs = [SeqInfo("short", 300, 95, 100), SeqInfo("long", 4000, 10, 900), SeqInfo("mid", 1500, 10, 600),
            SeqInfo("idle", 800, 0, 300, state="waiting")]
    out = plan_moves(seqs, GEAR_A.plans[0], [(GEAR_B.plans[0], 1.0)], M8, two_nodes(), drain_budget_s=1.0,
                     bw_share=0.5, source_step_s=0.02)
    assert [d.seq_id for d in out] == ["long", "mid", "short", "idle"]
    by = {d.seq_id: d for d in out}
    assert by["short"].action == "finish"  # 5 tokens left: 0.1 s on the old plan
    assert by["long"].action in ("migrate", "replay") and by["long"].target_plan == GEAR_B.plans[0].plan_id
    assert by["idle"].lazy and by["idle"].action != "finish"


def test_plan_moves_replays_a_sequence_whose_kv_is_lost_and_never_leaves_it_to_finish() -> None:

    out = plan_moves([SeqInfo("s", 2000, 5, 10, kv_lost=True)], GEAR_A.plans[0], [(GEAR_B.plans[0], 1.0)], M8,
                     two_nodes(), drain_budget_s=100.0, bw_share=0.5, source_step_s=0.02)
    assert out[0].action == "replay"


def test_a_throttled_slow_link_turns_migration_into_replay() -> None:

    def choice(gbps: float) -> str:
        snap = make_fleet([NodeSpec("a1"), NodeSpec("b1", rack="B")], now_s=0.0,
                          links=[LinkState("a1", "b1", gbps)])
        return plan_moves([SeqInfo("s", 3000, 10, 900)], GEAR_A.plans[0], [(GEAR_B.plans[0], 1.0)], M8, snap,
                          drain_budget_s=0.0, bw_share=0.5)[0].action

    assert choice(3200.0) == "migrate"  # a fast link: moving 3000 tokens of KV beats re-prefilling them
    assert choice(1.0) == "replay"  # 1 Gb/s: recomputing is cheaper


def test_a_plan_that_loses_its_gpus_while_draining_hands_what_is_left_to_the_new_gear() -> None:
    w = busy_world(config=replace(World().config, drain_budget_s=5.0))  # most sequences stay to finish
    w.start(DEP, GEAR_C)
    ex = w.executor()
    while not w.store.active(DEP).started(Step.RELEASE):  # type: ignore[union-attr]
        ex.advance(DEP)
        w.step()
    old = w.fleet.engine(DEP, GEAR_A.plans[0].plan_id)
    left = w.fleet.sequences(DEP, GEAR_A.plans[0].plan_id)
    assert old is not None and old.release_when_empty and left, "sequences were left to finish on the old plan"
    lost_at = w.clock.now_s
    w.fleet.lose_gpus(list(GEAR_A.plans[0].gpu_uuids))  # the old plan breaks in the middle of its drain
    rec = w.drive(DEP, ex)
    assert rec.phase is Phase.DONE
    # its KV went with its GPUs: each sequence left there is recomputed on the new gear's plan
    new = GEAR_C.plans[0].plan_id
    landed = {e.seq_id for e in w.log.of("seq_assigned", "seq_handover")
              if e.t_s >= lost_at and new in (e.plan_id, e.to_plan)}
    assert left <= landed
    finish(w, rec)  # none of them failed


def test_a_switch_whose_moves_the_cost_model_cannot_price_still_saves_strict_json_and_ends() -> None:
    # no link measured between the racks and no rack default (what a fresh console knows): both a
    # migration and a replay onto a plan that spans the two nodes cost "infinity". The database
    # refuses Infinity in JSON, so such a figure saved in the move step would stop every worker
    # at the same save, for ever; the in-memory store refuses it just the same.
    # (the cluster has its rack default; only what the console knows lacks it)
    w = busy_world(known=lambda snap: replace(snap, inter_rack_gbps=0.0))
    half = M8.num_layers // 2
    two = replace(GEAR_B, plans=(replace(GEAR_B.plans[0], stages=(
        replace(GEAR_B.plans[0].stages[0], layer_end=half, gpu_uuids=("b1-g0", "b1-g1")),
        replace(GEAR_B.plans[0].stages[0], layer_start=half, gpu_uuids=("a1-g4", "a1-g5")))),))
    w.start(DEP, two)
    rec = w.drive(DEP)
    assert rec.phase is Phase.DONE, rec.error
    move = rec.attempts(Step.MOVE)[0]
    moves = [m for c in move.intent.commands for m in c.payload["moves"]]  # type: ignore[union-attr]
    assert moves and all(m["est_stall_s"] == 0.0 for m in moves if m["action"] != "finish")
    assert move.intent.timeout_s == w.config.move_timeout_s  # no estimate to add to the base timeout
    json.dumps(rec.to_dict(), allow_nan=False)
    finish(w, rec)
