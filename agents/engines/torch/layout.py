"""Layout: how one engine cuts the model into processes — small, frozen, JSON-serialisable.

    {"mode": "colocated",
     "stages": [{"layer_start": 0, "layer_end": 2, "tp": 2}, {"layer_start": 2, "layer_end": 4, "tp": 2}]}

    {"mode": "disaggregated",
     "prefill_stages": [{"layer_start": 0, "layer_end": 4, "tp": 1}],
     "stages": [{"layer_start": 0, "layer_end": 4, "tp": 2}]}

`stages` is the group that decodes (and, when colocated, also prefills); `prefill_stages`, only
in disaggregated mode, is a separate group that prefills and hands each sequence's KV to
`stages` after its first token. Each list is a pipeline: stage i holds layers
[layer_start, layer_end) on `tp` processes; the lists must cover the model's layers exactly once,
in order. The scheduler's Plan maps onto this (one Plan stage -> one entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agents.engines.torch.model import ModelConfig, tp_problems

Mode = Literal["colocated", "disaggregated"]
MODES: tuple[str, ...] = ("colocated", "disaggregated")


class LayoutError(ValueError):
    """The layout cannot run this model; `reasons` says why, each naming the field."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("bad layout: " + "; ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True)
class StageSpec:
    layer_start: int  # first layer of the stage
    layer_end: int  # one past the last layer
    tp: int = 1  # processes sharing the stage's heads and MLP columns

    def to_dict(self) -> dict[str, int]:
        return {"layer_start": self.layer_start, "layer_end": self.layer_end, "tp": self.tp}


@dataclass(frozen=True)
class Layout:
    stages: tuple[StageSpec, ...]
    mode: Mode = "colocated"
    prefill_stages: tuple[StageSpec, ...] = field(default=())

    # -- constructors for the common shapes ------------------------------------------------------

    @classmethod
    def pipeline(cls, num_layers: int, pp: int = 1, tp: int = 1) -> Layout:
        """pp stages of (nearly) equal layer counts, each on tp processes."""
        return cls(stages=_split(num_layers, pp, tp))

    @classmethod
    def disaggregated(
        cls,
        num_layers: int,
        *,
        prefill_pp: int = 1,
        prefill_tp: int = 1,
        decode_pp: int = 1,
        decode_tp: int = 1,
    ) -> Layout:
        return cls(
            stages=_split(num_layers, decode_pp, decode_tp),
            mode="disaggregated",
            prefill_stages=_split(num_layers, prefill_pp, prefill_tp),
        )

    # -- properties ------------------------------------------------------------------------------

    @property
    def groups(self) -> dict[str, tuple[StageSpec, ...]]:
        """Worker groups by name: {"main": ...} or {"prefill": ..., "decode": ...}."""
        if self.mode == "disaggregated":
            return {"prefill": self.prefill_stages, "decode": self.stages}
        return {"main": self.stages}

    @property
    def num_processes(self) -> int:
        return sum(s.tp for s in self.stages) + sum(s.tp for s in self.prefill_stages)

    def describe(self) -> str:
        def one(stages: tuple[StageSpec, ...]) -> str:
            return "+".join(f"L{s.layer_start}-{s.layer_end - 1}xTP{s.tp}" for s in stages)

        if self.mode == "disaggregated":
            return f"disagg[prefill {one(self.prefill_stages)} | decode {one(self.stages)}]"
        return one(self.stages)

    # -- validation ------------------------------------------------------------------------------

    def problems(self, cfg: ModelConfig | None = None) -> list[str]:
        """Every reason this layout cannot run (the model's, when `cfg` is given); empty if it can."""
        reasons: list[str] = []
        if self.mode not in MODES:
            reasons.append(f"mode: must be one of {list(MODES)}, got {self.mode!r}")
        if self.mode == "colocated" and self.prefill_stages:
            reasons.append("prefill_stages: only a disaggregated layout has a separate prefill group")
        if self.mode == "disaggregated" and not self.prefill_stages:
            reasons.append("prefill_stages: a disaggregated layout needs a prefill group")
        for name, stages in (("stages", self.stages), ("prefill_stages", self.prefill_stages)):
            if name == "stages" or stages:
                reasons += _stage_problems(name, stages, cfg)
        return reasons

    def validate(self, cfg: ModelConfig | None = None) -> None:
        reasons = self.problems(cfg)
        if reasons:
            raise LayoutError(reasons)

    # -- JSON ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"mode": self.mode, "stages": [s.to_dict() for s in self.stages]}
        if self.prefill_stages:
            out["prefill_stages"] = [s.to_dict() for s in self.prefill_stages]
        return out

    @classmethod
    def from_dict(cls, data: object) -> Layout:
        """Parse the JSON shape above; every error names the offending field."""
        if not isinstance(data, dict):
            raise LayoutError([f"layout: must be an object, got {type(data).__name__}"])
        unknown = set(data) - {"mode", "stages", "prefill_stages"}
        if unknown:
            raise LayoutError([f"layout: unknown key(s) {sorted(unknown)}"])
        mode = data.get("mode", "colocated")
        if mode not in MODES:
            raise LayoutError([f"mode: must be one of {list(MODES)}, got {mode!r}"])
        layout = cls(
            stages=_stages_from(data.get("stages"), "stages"),
            mode=mode,
            prefill_stages=_stages_from(data.get("prefill_stages", []), "prefill_stages"),
        )
        layout.validate()
        return layout


def _split(num_layers: int, pp: int, tp: int) -> tuple[StageSpec, ...]:
    if pp < 1 or pp > num_layers:
        raise LayoutError([f"pp: must be in [1, {num_layers}] for {num_layers} layers, got {pp}"])
    bounds = [num_layers * i // pp for i in range(pp + 1)]
    return tuple(StageSpec(bounds[i], bounds[i + 1], tp) for i in range(pp))


def _stages_from(raw: object, name: str) -> tuple[StageSpec, ...]:
    if not isinstance(raw, list):
        raise LayoutError([f"{name}: must be a list of stages, got {type(raw).__name__}"])
    out = []
    for i, item in enumerate(raw):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise LayoutError([f"{where}: must be an object, got {type(item).__name__}"])
        unknown = set(item) - {"layer_start", "layer_end", "tp"}
        if unknown:
            raise LayoutError([f"{where}: unknown key(s) {sorted(unknown)}"])
        values = []
        for key in ("layer_start", "layer_end", "tp"):
            value = item.get(key, 1 if key == "tp" else None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError([f"{where}.{key}: must be an integer, got {value!r}"])
            values.append(value)
        out.append(StageSpec(*values))
    return tuple(out)


def _stage_problems(name: str, stages: tuple[StageSpec, ...], cfg: ModelConfig | None) -> list[str]:
    """The stages must tile [0, num_layers) in order, each non-empty, each tp shardable."""
    if not stages:
        return [f"{name}: needs at least one stage"]
    reasons = []
    expected_start = 0
    for i, s in enumerate(stages):
        where = f"{name}[{i}]"
        if s.layer_start != expected_start:
            what = "overlaps the previous stage" if s.layer_start < expected_start else "leaves a gap"
            reasons.append(
                f"{where}.layer_start: {s.layer_start} {what}; expected {expected_start} "
                "(stages must cover every layer exactly once, in order)"
            )
        if s.layer_end <= s.layer_start:
            reasons.append(
                f"{where}.layer_end: {s.layer_end} must be greater than layer_start {s.layer_start}"
            )
        if not isinstance(s.tp, int) or s.tp < 1:
            reasons.append(f"{where}.tp: must be a positive integer, got {s.tp!r}")
        elif cfg is not None:
            reasons += [f"{where}.tp: {why}" for why in tp_problems(cfg, s.tp)]
        expected_start = max(expected_start, s.layer_end)
    if cfg is not None and expected_start != cfg.num_layers:
        reasons.append(
            f"{name}[{len(stages) - 1}].layer_end: the stages end at layer {expected_start}, "
            f"the model has {cfg.num_layers} layers (stages must cover every layer exactly once)"
        )
    return reasons
