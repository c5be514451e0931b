"""The stall bench measures what it says, and the cost model picks the cheaper hand-over it measures."""

from __future__ import annotations

import pytest

from bench.transition_stall import CASES, main, measure


@pytest.mark.parametrize("case", CASES, ids=[c.model for c in CASES])
@pytest.mark.parametrize("gbps", [100.0, 400.0])
def test_the_cost_model_picks_the_hand_over_the_simulated_agents_measure_as_cheaper(case: object, gbps: float) -> None:
    ctx = case.contexts[-1]  # type: ignore[attr-defined]
    migrate = measure(case, gbps, "migrate", ctx)  # type: ignore[arg-type]
    replay = measure(case, gbps, "replay", ctx)  # type: ignore[arg-type]
    faster = "migrate" if float(migrate["stall_s"]) < float(replay["stall_s"]) else "replay"  # type: ignore[arg-type]
    assert migrate["chosen"] == faster
    assert int(migrate["kv_bytes"]) > 0 and int(replay["kv_bytes"]) == 0  # type: ignore[call-overload]


def test_a_faster_link_shortens_a_migration_and_leaves_a_replay_alone() -> None:
    case = CASES[0]
    slow, fast = measure(case, 100.0, "migrate", 2048), measure(case, 400.0, "migrate", 2048)
    assert float(fast["stall_s"]) < float(slow["stall_s"])  # type: ignore[arg-type]
    assert measure(case, 100.0, "replay", 2048)["stall_s"] == measure(case, 400.0, "replay", 2048)["stall_s"]


def test_it_prints_a_row_per_model_link_and_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--links", "100"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert len(rows) == sum(len(c.contexts) for c in CASES)
