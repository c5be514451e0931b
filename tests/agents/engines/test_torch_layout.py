"""Layouts: the JSON shape, and bad layouts rejected with reasons that name the field."""

from __future__ import annotations

import json

import pytest

from agents.engines.torch.engine import TorchEngine
from agents.engines.torch.layout import Layout, LayoutError, StageSpec
from tests.agents.engines.conftest import TinyModel

pytestmark = pytest.mark.timeout(60)


def test_layouts_round_trip_through_json() -> None:
    for layout in (
        Layout.pipeline(4, pp=2, tp=2),
        Layout(stages=(StageSpec(0, 1, 1), StageSpec(1, 4, 2))),
        Layout.disaggregated(4, prefill_pp=2, decode_tp=2),
    ):
        assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_the_json_shape_is_small_and_plain() -> None:
    assert Layout.disaggregated(4, decode_tp=2).to_dict() == {
        "mode": "disaggregated",
        "stages": [{"layer_start": 0, "layer_end": 4, "tp": 2}],
        "prefill_stages": [{"layer_start": 0, "layer_end": 4, "tp": 1}],
    }
    assert Layout.pipeline(4, pp=2).to_dict() == {
        "mode": "colocated",
        "stages": [{"layer_start": 0, "layer_end": 2, "tp": 1}, {"layer_start": 2, "layer_end": 4, "tp": 1}],
    }
    assert Layout.pipeline(4, pp=2, tp=2).num_processes == 4
    assert Layout.disaggregated(4, decode_tp=2).groups.keys() == {"prefill", "decode"}


@pytest.mark.parametrize(
    ("stages", "reason"),
    [
        ([(0, 2, 1), (3, 4, 1)], r"stages\[1\].layer_start: 3 leaves a gap; expected 2"),
        ([(0, 3, 1), (2, 4, 1)], r"stages\[1\].layer_start: 2 overlaps the previous stage"),
        ([(0, 2, 1), (2, 3, 1)], r"stages\[1\].layer_end: the stages end at layer 3, the model has 4 layers"),
        ([(0, 5, 1)], r"the stages end at layer 5, the model has 4"),
        ([(1, 4, 1)], r"stages\[0\].layer_start: 1 leaves a gap; expected 0"),
        ([(0, 2, 1), (2, 2, 1), (2, 4, 1)], r"stages\[1\].layer_end: 2 must be greater than layer_start 2"),
        ([(0, 4, 3)], r"stages\[0\].tp: tp 3 does not divide num_attention_heads 4"),
        ([(0, 2, 2), (2, 4, 8)], r"stages\[1\].tp: tp 8 does not divide num_attention_heads 4"),
        ([(0, 4, 0)], r"stages\[0\].tp: must be a positive integer"),
        ([], r"stages: needs at least one stage"),
    ],
)
def test_bad_stages_are_rejected_with_the_reason(
    tiny_model: TinyModel, stages: list[tuple[int, int, int]], reason: str
) -> None:
    layout = Layout(stages=tuple(StageSpec(*s) for s in stages))
    with pytest.raises(LayoutError, match=reason):
        layout.validate(tiny_model.cfg)


def test_every_problem_is_reported_at_once(tiny_model: TinyModel) -> None:
    layout = Layout(stages=(StageSpec(0, 1, 3), StageSpec(2, 4, 1)))
    problems = layout.problems(tiny_model.cfg)
    # tp 3 against the query heads, the KV heads and the MLP columns, and the gap
    assert len(problems) == 4
    assert [p.split(":")[0] for p in problems] == ["stages[0].tp"] * 3 + ["stages[1].layer_start"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"mode": "mixed", "stages": []}, r"mode: must be one of"),
        ({"stages": [{"layer_start": 0, "layer_end": 4, "tp": "2"}]}, r"stages\[0\].tp: must be an integer"),
        (
            {"stages": [{"layer_start": 0, "layer_end": 4, "pp": 2}]},
            r"stages\[0\]: unknown key\(s\) \['pp'\]",
        ),
        ({"stages": [{"layer_end": 4}]}, r"stages\[0\].layer_start: must be an integer, got None"),
        ({"stages": "0-4"}, r"stages: must be a list"),
        ({"stages": [], "gpus": [0]}, r"layout: unknown key"),
        (
            {"mode": "disaggregated", "stages": [{"layer_start": 0, "layer_end": 4}]},
            r"prefill_stages: a disaggregated",
        ),
        (
            {
                "mode": "colocated",
                "stages": [{"layer_start": 0, "layer_end": 4}],
                "prefill_stages": [{"layer_start": 0, "layer_end": 4}],
            },
            r"prefill_stages: only a disaggregated layout",
        ),
        ([1, 2], r"layout: must be an object"),
    ],
)
def test_bad_json_is_rejected_naming_the_field(data: object, reason: str) -> None:
    with pytest.raises(LayoutError, match=reason):
        Layout.from_dict(data)


def test_the_prefill_group_of_a_disaggregated_layout_is_checked_too(tiny_model: TinyModel) -> None:
    layout = Layout(stages=(StageSpec(0, 4, 2),), mode="disaggregated", prefill_stages=(StageSpec(0, 3, 1),))
    with pytest.raises(LayoutError, match=r"prefill_stages\[0\].layer_end: the stages end at layer 3"):
        layout.validate(tiny_model.cfg)


def test_the_engine_refuses_a_bad_layout_before_starting_any_process(tiny_model: TinyModel) -> None:
    with pytest.raises(LayoutError, match="tp 3 does not divide"):
        TorchEngine(tiny_model.path, {"stages": [{"layer_start": 0, "layer_end": 4, "tp": 3}]})
    with pytest.raises(LayoutError, match="pp: must be in"):
        Layout.pipeline(4, pp=5)
