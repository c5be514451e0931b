"""The invariant checker finds each kind of violation in a crafted history, and none in a clean one."""

from __future__ import annotations

import pytest

from scheduler.invariants import CheckingLog, LogEvent, assert_clean, check


def ev(t: float, kind: str, **kw: object) -> LogEvent:
    return LogEvent(t, kind, **kw)  # type: ignore[arg-type]


def admitted(seq_id: str = "s1", plan: str = "pA", version: int = 1, t: float = 0.0) -> list[LogEvent]:
    return [ev(t, "seq_admitted", deployment="d", seq_id=seq_id),
            ev(t, "seq_assigned", deployment="d", seq_id=seq_id, plan_id=plan, version=version)]


def handover(seq_id: str = "s1", src: str = "pA", dst: str = "pB", version: int = 2, t: float = 1.0,
             boundary: str = "decode_end") -> list[LogEvent]:
    return [ev(t, "seq_paused", seq_id=seq_id, plan_id=src, boundary=boundary),
            ev(t, "seq_handover", seq_id=seq_id, plan_id=src, to_plan=dst, version=version, boundary=boundary)]


def transition(seq: int = 1, dep: str = "d", t: float = 0.0) -> list[LogEvent]:
    return [ev(t, "created", deployment=dep, seq=seq, phase="prepare"),
            ev(t, "step_started", deployment=dep, seq=seq, step="reserve", attempt=1, phase="prepare")]


def ended(seq: int = 1, dep: str = "d", t: float = 9.0, path: tuple[str, ...] = ("switch", "cleanup", "done")
          ) -> list[LogEvent]:
    return [ev(t, "phase", deployment=dep, seq=seq, phase=p) for p in path] + [
        ev(t, "finished", deployment=dep, seq=seq, phase=path[-1])]


def only(found: list[object], invariant: int, words: str) -> None:
    assert len(found) == 1, found
    v = found[0]
    assert v.invariant == invariant and words in v.what, v  # type: ignore[attr-defined]


def test_a_clean_history_has_no_violation() -> None:
    log = (transition() + admitted() + [ev(0.5, "seq_decoded", seq_id="s1", plan_id="pA")] + handover()
           + [ev(2.0, "seq_decoded", seq_id="s1", plan_id="pB"), ev(3.0, "seq_finished", seq_id="s1", plan_id="pB")]
           + ended())
    assert check(log) == []
    assert_clean(log)


# --- invariant 1 ----------------------------------------------------------------------------------
def test_a_sequence_that_never_ends_is_lost() -> None:
    only(check(admitted()), 1, "never finished nor failed")


def test_an_open_sequence_is_fine_while_the_history_is_not_complete() -> None:
    assert check(admitted(), complete=False) == []


def test_a_sequence_finished_twice_is_a_duplicate() -> None:
    log = admitted() + [ev(1, "seq_finished", seq_id="s1", plan_id="pA"), ev(2, "seq_finished", seq_id="s1",
                                                                              plan_id="pA")]
    only(check(log), 1, "after it had ended")


def test_a_failure_needs_a_recorded_reason() -> None:
    only(check(admitted() + [ev(1, "seq_failed", seq_id="s1")]), 1, "without a recorded reason")
    assert check(admitted() + [ev(1, "seq_failed", seq_id="s1", detail="node lost")]) == []


def test_admitting_one_id_twice_is_caught() -> None:
    found = check(admitted() + admitted() + [ev(1, "seq_finished", seq_id="s1", plan_id="pA")])
    assert any(v.invariant == 1 and "admitted twice" in v.what for v in found)


def test_an_event_for_a_sequence_never_admitted_is_caught() -> None:
    only(check([ev(1, "seq_finished", seq_id="ghost", plan_id="pA")]), 1, "never admitted")


# --- invariant 2 ----------------------------------------------------------------------------------
def test_only_the_owner_may_decode_a_sequence() -> None:
    log = admitted() + [ev(1, "seq_decoded", seq_id="s1", plan_id="pB"), ev(2, "seq_finished", seq_id="s1",
                                                                             plan_id="pA")]
    only(check(log), 2, "decoded sequence s1 but pA owns it")


def test_a_hand_over_must_start_from_the_owner() -> None:
    log = admitted() + handover(src="pX") + [ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    found = check(log)
    assert any(v.invariant == 2 and "owned by pA" in v.what for v in found)


def test_a_hand_over_needs_a_pause_at_a_safe_boundary() -> None:
    log = admitted() + [ev(1, "seq_handover", seq_id="s1", plan_id="pA", to_plan="pB", version=2)] + [
        ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(log), 2, "without a pause at a safe boundary")
    mid = admitted() + handover(boundary="mid_iteration") + [ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    assert any("not a safe one" in v.what for v in check(mid))


def test_a_hand_over_needs_a_newer_lease() -> None:
    log = admitted(version=5) + handover(version=5) + [ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(log), 2, "not newer than 5")


def test_the_old_owner_may_not_finish_a_sequence_it_handed_over() -> None:
    log = admitted() + handover() + [ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(log), 2, "owned by pB")


def test_a_second_assignment_while_owned_is_caught() -> None:
    log = admitted() + [ev(1, "seq_assigned", seq_id="s1", plan_id="pB", version=2),
                        ev(2, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(log), 2, "while pA owns it")


def test_a_sequence_returned_to_the_router_may_be_assigned_again() -> None:
    back = [ev(1, "seq_returned", seq_id="s1", plan_id="pA", detail="its plan stopped"),
            ev(2, "seq_assigned", seq_id="s1", plan_id="pB", version=1), ev(3, "seq_finished", seq_id="s1",
                                                                           plan_id="pB")]
    assert check(admitted() + back) == []


def test_only_its_owner_may_return_a_sequence_and_only_with_a_reason() -> None:
    stranger = [ev(1, "seq_returned", seq_id="s1", plan_id="pX", detail="stopped"),
                ev(2, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(admitted() + stranger), 2, "returned sequence s1 owned by pA")
    silent = [ev(1, "seq_returned", seq_id="s1", plan_id="pA"), ev(2, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(admitted() + silent), 2, "without a recorded reason")


def test_the_old_owner_may_not_finish_a_sequence_it_returned() -> None:
    log = admitted() + [ev(1, "seq_returned", seq_id="s1", plan_id="pA", detail="stopped"),
                        ev(2, "seq_finished", seq_id="s1", plan_id="pA")]
    only(check(log), 2, "owned by no plan")


def test_a_checking_log_finds_what_check_finds_without_keeping_the_events() -> None:
    log = admitted() + handover(src="pX") + admitted("s2") + [ev(3, "seq_finished", seq_id="s1", plan_id="pA")]
    streamed = CheckingLog()
    for e in log:
        streamed.add(e)
    assert [str(v) for v in streamed.checker.violations()] == [str(v) for v in check(log)]
    assert len(check(log)) >= 2 and streamed.events == [] and streamed.counts["seq_admitted"] == 2


# --- invariant 3 ----------------------------------------------------------------------------------
def test_two_active_transitions_of_one_deployment_are_caught() -> None:
    log = transition(1) + transition(2) + ended(2)
    found = check(log)
    assert any(v.invariant == 3 and "while 1 is active" in v.what for v in found)


def test_seqs_must_strictly_increase() -> None:
    log = transition(3) + ended(3) + transition(2) + ended(2)
    found = check(log)
    assert any("is not above 3" in v.what for v in found)


def test_an_effect_before_its_step_was_persisted_is_caught() -> None:
    log = transition() + [ev(1, "command_issued", deployment="d", seq=1, step="prepare", attempt=1)] + ended()
    only(check(log), 3, "before the step was persisted")


def test_a_phase_change_outside_the_table_is_caught() -> None:
    log = transition() + ended(path=("cleanup", "done"))
    found = check(log)
    assert any("went from prepare to cleanup" in v.what for v in found)


def test_a_transition_that_never_ends_is_half_done() -> None:
    only(check(transition()), 3, "never finished")


def test_routing_to_a_released_plan_is_caught_both_ways() -> None:
    routed = [ev(1, "routing_committed", deployment="d", version=2, plans=(("pA", 1.0, False),))]
    released_while_routed = routed + [ev(2, "plan_released", node="n1", plan_id="pA")]
    only(check(released_while_routed), 3, "while the routing table of d lists it")
    routes_released = [ev(1, "plan_aborted", node="n1", plan_id="pA")] + routed
    only(check(routes_released), 3, "lists released plan(s) pA")
    prepared_again = [ev(1, "plan_aborted", node="n1", plan_id="pA"), ev(2, "plan_prepared", node="n1",
                                                                          plan_id="pA")] + routed
    assert check(prepared_again) == []


def test_assert_clean_lists_what_it_found() -> None:
    with pytest.raises(AssertionError, match="invariant 1"):
        assert_clean(admitted())
