"""The pool's scale rule on token-weighted utilisation, and per-model soft limits (seed 004 §3.2).

`scale_signal(samples, now_s, deployment)` -> ScaleSignal(direction, reason): OUT when the mean
TWU (twu.py) of both the short and the long window of the deployment's load window is above the
high watermark (default 0.85), IN when both are below the low one (default 0.4), HOLD otherwise.
The samples are one deployment's TWU per report interval - recorded by the caller, or derived from
its load window by `load_twu_samples` (`gear_twu_samples` prices the gear's plans first). The control
loop reads it as its rule 11 (scheduler/control/loop.py): OUT or IN makes that step's gearbox
decision a LOAD one asking for more or less capacity (`gearbox.decide(capacity_ask=...)`).
The seed's text says the same - below 0.4 the GPUs have idle cycles, above 0.85 requests queue -
while its example config names the threshold under 0.4 "scale up": that contradicts the text,
and we follow the text.

Hysteresis, as the gearbox has it (scheduler/gearbox.py GearboxConfig):
  * the windows are the gearbox's (`short_window_s`, `long_window_s`) and both must agree, so one
    spike does not move the pool;
  * no signal within the gearbox's cooldown after the deployment's last chosen switch (the long
    one after two switches within the flap window: `gearbox.cooldown_until`), none for a pinned
    or emergency deployment, and none on silence (a window without samples holds: missing
    telemetry is not zero load);
  * the band itself: `ScaleConfig` requires 2 x low < high, so a scale-in from n >= 2 replicas to
    n - 1 lands below the high watermark (TWU x n / (n - 1) <= 2 x low) and a scale-out from n to
    n + 1 lands above the low one (TWU x n / (n + 1) >= high / 2) - neither undoes itself at the
    next tick;
  * the gain against cost x `hysteresis` stays the gearbox's: the signal is a trigger, and the
    gear the control loop scales to is still priced by `gearbox.decide`.
Trend (`rise`, from `gearbox.planned_load`): on a rising load the OUT test reads both means x the
forecast's rise over the level - scaling out ahead of the tide; the IN test never does, and it
holds while the load climbs (`slope_t`): no scale-in into a rise.
Replica bounds (the deployment's min/max replicas) turn an OUT at the maximum or an IN at the
minimum into HOLD, with the reason.

`admission_shares(weights, pool_twu)`: each model's share of the pool's admission. Its weight
(the seed's example: Phi-3-mini 1.0, Llama-3-8B 2.3, Qwen2-72B 8.7, console settings
FLEXPIPE_POOL_MODEL_WEIGHTS) is its base share. Above the soft limit (0.8 pool TWU) the weights
shrink in proportion to how heavy the model is - w_m x (1 - (1 - min_factor) x (w_m / w_max) x
pressure), pressure rising from 0 at the soft limit to 1 at `full_pressure_twu` - so the
heaviest model is at 0.6 x its weight at full pressure (the seed's x 0.6 for Qwen2-72B) and the
light ones hardly move; the shares are renormalised, so lighter models gain what the heavy one
gives up. Nobody is rejected: a share is never 0, and what a model cannot admit now waits in its
queue. The seed switches at 0.8 in one step; we ramp, so the shares do not jump back and forth
as the pool's TWU wanders around 0.8. The control loop applies them as the seed says - "lower the
heavy model's scheduling priority": within one priority, deployments decide in the order of their
model's factor, so the light ones' scale-outs get free GPUs first (scheduler/control/loop.py rule
14); /metrics shows the shares (console/metrics/gearbox.py). `parse_weights` reads the
"model=weight,..." form of the setting and of bench.pool's --weights.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.costmodel import PlanProfile
from scheduler.gearbox import DEFAULT_CONFIG, GearboxConfig, LoadWindow, Mode, cooldown_until
from scheduler.gearbox import Deployment as GearboxDeployment
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear
from scheduler.pool.twu import PlanTokens, PlanTwu, TokenCosts, deployment_twu, plan_twu
from scheduler.topology import Snapshot

SEED_004_WEIGHTS: Mapping[str, float] = {"Phi-3-mini": 1.0, "Llama-3-8B": 2.3, "Qwen2-72B": 8.7}
"""The seed's example soft-limit weights (seed 004 §3.2)."""


class Direction(enum.StrEnum):
    OUT = "out"  # add GPUs / replicas
    IN = "in"  # give GPUs back
    HOLD = "hold"


@dataclass(frozen=True)
class ScaleConfig:
    """Knobs of the scale rule and of the soft limits; defaults from seed 004 §3.2."""

    high_watermark: float = 0.85  # both windows above: scale out
    low_watermark: float = 0.4  # both windows below: scale in
    soft_limit_twu: float = 0.8  # pool TWU above which admission shares shrink
    full_pressure_twu: float = 1.0  # ... and reach their floor here
    min_weight_factor: float = 0.6  # the heaviest model's weight factor at full pressure

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark:
            raise ValueError(f"low_watermark/high_watermark: need 0 < low < high, got {self.low_watermark}, "
                             f"{self.high_watermark}")
        if not 2 * self.low_watermark < self.high_watermark:
            raise ValueError(f"low_watermark: must be under half the high watermark ({self.high_watermark / 2:g}) so a "
                             f"scale-in never lands above it; got {self.low_watermark}")
        if not 0 < self.soft_limit_twu < self.full_pressure_twu:
            raise ValueError(f"soft_limit_twu: need 0 < soft_limit_twu < full_pressure_twu, got {self.soft_limit_twu}, "
                             f"{self.full_pressure_twu}")
        if not 0 < self.min_weight_factor <= 1:
            raise ValueError(f"min_weight_factor: must be within (0, 1], got {self.min_weight_factor}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, object], path: str = "pool") -> ScaleConfig:
        """From settings: known keys only, numbers only; errors name the key."""
        known = {f for f in cls.__dataclass_fields__}
        values: dict[str, float] = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"{path}.{key}: unknown key (known: {', '.join(sorted(known))})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{path}.{key}: must be a finite number, got {value!r}")
            values[key] = float(value)
        return cls(**values)


DEFAULT_SCALE = ScaleConfig()


@dataclass(frozen=True)
class TwuSample:
    """One deployment's TWU over one report interval (twu.deployment_twu)."""

    t_s: float  # end of the interval
    twu: float


@dataclass(frozen=True)
class ScaleSignal:
    direction: Direction
    reason: str
    short_twu: float | None = None  # mean TWU of the short window (None: no samples)
    long_twu: float | None = None  # ... of the long window


def load_twu_samples(window: LoadWindow, gear: Gear, costs: Mapping[str, TokenCosts]) -> tuple[TwuSample, ...]:
    """TWU samples from a deployment's load window, for a control loop that keeps no TWU history of
    its own: each LoadSample (arrivals per second and the request shape, from the same engine
    reports) split over the gear's plans by routing weight, as tokens over one second - rate x
    prompt mean prompt tokens and rate x output mean output tokens per plan, priced by `costs`
    (plan id -> TokenCosts; twu.deployment_twu over the plans). That is the *offered* TWU: equal to
    the served one in steady state, above it (and above 1) while a queue grows - which is what the
    scale rule should see then. Its backlog is not counted (the gearbox adds it to the rate; the
    scale rule waits for the windows instead). A plan without costs leaves the sample out."""
    out: list[TwuSample] = []
    for s in window.samples:
        plans: list[PlanTwu | None] = []
        for plan, weight in zip(gear.plans, gear.weights, strict=True):
            c = costs.get(plan.plan_id)
            if c is None:
                plans = []
                break
            rate = s.rate_rps * weight
            plans.append(plan_twu(plan, c, PlanTokens(plan.plan_id, 1.0, rate * s.prompt_tokens_mean,
                                                      rate * s.output_tokens_mean)))
        value = deployment_twu(plans) if plans else None
        if value is not None:
            out.append(TwuSample(s.t_s, value))
    return tuple(out)


def gear_twu_samples(window: LoadWindow, gear: Gear, model: ModelSpec, snapshot: Snapshot, now_s: float,
                     gearbox: GearboxConfig = DEFAULT_CONFIG) -> tuple[TwuSample, ...]:
    """`load_twu_samples` with each plan of `gear` priced on `snapshot` (PlanProfile.build, then
    TokenCosts.of) under the long window's request shape: what the control loop's TWU rule reads
    (scheduler/control/loop.py). No samples in the long window, or a plan the snapshot cannot price
    (a GPU it no longer lists), give no samples: silence, which holds."""
    shape = window.over(now_s, gearbox.long_window_s)
    if shape is None:
        return ()
    costs: dict[str, TokenCosts] = {}
    for plan in gear.plans:
        try:
            costs[plan.plan_id] = TokenCosts.of(PlanProfile.build(plan, model, snapshot), shape)
        except (KeyError, ValueError):
            return ()
    return load_twu_samples(window, gear, costs)


def window_mean(samples: Sequence[TwuSample], now_s: float, window_s: float) -> float | None:
    """Mean TWU of the samples in (now - window, now]; None if there are none."""
    chosen = [s.twu for s in samples if now_s - window_s < s.t_s <= now_s]
    return sum(chosen) / len(chosen) if chosen else None


def scale_signal(samples: Sequence[TwuSample], now_s: float, deployment: GearboxDeployment, *,
                 replicas: int | None = None, min_replicas: int = 0, max_replicas: int | None = None,
                 config: ScaleConfig = DEFAULT_SCALE, gearbox: GearboxConfig = DEFAULT_CONFIG,
                 rise: float = 1.0, slope_t: float = 0.0) -> ScaleSignal:
    """Whether the deployment should scale out, in or hold now (module docstring). `rise` (>= 1,
    `gearbox.Planned.rise`: the rising trend's forecast over the level) scales both means for the
    OUT test only: TWU is linear in the rate at one request shape, so that is the TWU the gear will
    see by the time a switch could serve; the IN test reads the measured means (never shrink on a
    forecast), and `slope_t` (`gearbox.Planned.slope_t`: the load window's slope in standard
    errors) holds it while the load climbs (at `trend_hold_in_t` and above) - and, where the
    scale-in would start the long cooldown (a switch within the flap window: out, then in, is a
    flap), until the load clearly falls (at -`trend_hold_in_t` and below): a gear given back too
    soon is held small through the long cooldown, whatever the load does then."""
    if not rise >= 1.0:
        raise ValueError(f"rise: must be >= 1 (a forecast only ever raises the load); got {rise}")
    short = window_mean(samples, now_s, gearbox.short_window_s)
    long = window_mean(samples, now_s, gearbox.long_window_s)

    def signal(direction: Direction, reason: str) -> ScaleSignal:
        return ScaleSignal(direction, reason, short, long)

    if deployment.mode in (Mode.PINNED, Mode.EMERGENCY):
        return signal(Direction.HOLD, f"{deployment.mode.value}: never scaled automatically")
    if short is None or long is None:
        which = "short" if short is None else "long"
        return signal(Direction.HOLD, f"no TWU samples in the {which} window: silence is not zero load")
    seen = f"TWU {short:.2f} (short window, {gearbox.short_window_s:.0f} s) and {long:.2f} (long, " \
           f"{gearbox.long_window_s:.0f} s)"
    if min(short, long) * rise > config.high_watermark:
        direction = Direction.OUT
        why = f"{seen}: both above the high watermark {config.high_watermark:.2f}"
        if min(short, long) <= config.high_watermark:
            why = (f"{seen}, x {rise:.2f} at the rising trend's forecast: both above the high watermark "
                   f"{config.high_watermark:.2f}")
    elif max(short, long) < config.low_watermark:
        direction = Direction.IN
        why = f"{seen}: both below the low watermark {config.low_watermark:.2f}"
    else:
        return signal(Direction.HOLD, f"{seen}: not both above {config.high_watermark:.2f} nor both below "
                                      f"{config.low_watermark:.2f}")
    until = cooldown_until(deployment, gearbox)
    if until is not None and now_s < until:
        return signal(Direction.HOLD, f"{why}; but in the cooldown until t={until:.0f} s")
    if direction is Direction.IN and gearbox.trend:
        times = deployment.last_switch_times_s
        if slope_t >= gearbox.trend_hold_in_t:
            return signal(Direction.HOLD, f"{why}; but the load is rising (slope {slope_t:+.1f} standard errors): "
                                          "no scale-in into a rise")
        if (gearbox.trend_hold_flap and times and now_s - max(times) <= gearbox.flap_window_s
                and slope_t > -gearbox.trend_hold_in_t):
            return signal(Direction.HOLD, f"{why}; but a switch now would start the long cooldown and the load is "
                                          f"not clearly falling (slope {slope_t:+.1f} standard errors)")
    if replicas is not None:
        if direction is Direction.OUT and max_replicas is not None and replicas >= max_replicas:
            return signal(Direction.HOLD, f"{why}; but at max_replicas ({max_replicas})")
        if direction is Direction.IN and replicas <= max(1, min_replicas):
            return signal(Direction.HOLD, f"{why}; but at min_replicas ({max(1, min_replicas)}; scale to zero "
                                          "is the idle rule's)")
    return signal(direction, why)


@dataclass(frozen=True)
class AdmissionShares:
    shares: Mapping[str, float]  # model -> share of the pool's admission (sums to 1 over models with demand)
    factors: Mapping[str, float] = field(default_factory=dict)  # model -> the factor its weight was scaled by
    reason: str = ""


def parse_weights(raw: str, source: str) -> dict[str, float]:
    """"model=weight,..." (a setting, a flag: `source` names it in errors) -> {model: weight}; "" -> {}."""
    out: dict[str, float] = {}
    for item in filter(None, (i.strip() for i in raw.split(","))):
        name, _, weight = (part.strip() for part in item.partition("="))
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not name or not 0 < value < math.inf:
            raise ValueError(f"{source}: {item!r} is not model=weight with a finite weight > 0")
        out[name] = value
    return out


def check_weights(weights: Mapping[str, float], path: str = "weights") -> None:
    """Each soft-limit weight a finite number > 0; the error names the model."""
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0):
            raise ValueError(f"{path}.{name}: must be a finite number > 0, got {w!r}")


def model_weights(weights: Mapping[str, float], models: Iterable[str]) -> dict[str, float]:
    """The soft-limit weight of each of `models`: its configured one, 1.0 for a model not named."""
    return {m: weights.get(m, 1.0) for m in models}


def admission_shares(weights: Mapping[str, float], pool_twu: float | None, *,
                     demand: Mapping[str, float] | None = None,
                     config: ScaleConfig = DEFAULT_SCALE) -> AdmissionShares:
    """Each model's share of the pool's admission under its soft limit (module docstring).

    `demand` (model -> requests waiting or arriving): models with none get no share and theirs
    goes to the others; a model with demand but no weight is an error naming it. `pool_twu` None
    (no reports) is no pressure."""
    check_weights(weights)
    models = list(weights) if demand is None else [m for m, d in demand.items() if d > 0]
    missing = [m for m in models if m not in weights]
    if missing:
        raise ValueError(f"weights.{missing[0]}: no soft-limit weight for a model with demand")
    if not models:
        return AdmissionShares({}, {}, "no model has demand")
    heaviest = max(weights[m] for m in models)
    span = config.full_pressure_twu - config.soft_limit_twu
    twu = pool_twu if pool_twu is not None and math.isfinite(pool_twu) else 0.0
    pressure = min(1.0, max(0.0, (twu - config.soft_limit_twu) / span))
    factors = {m: 1.0 - (1.0 - config.min_weight_factor) * (weights[m] / heaviest) * pressure for m in models}
    scaled = {m: weights[m] * factors[m] for m in models}
    total = sum(scaled.values())
    shares = {m: scaled[m] / total for m in models}
    if pressure <= 0:
        reason = f"pool TWU {twu:.2f} within the soft limit {config.soft_limit_twu:.2f}: shares by weight"
    else:
        reason = (f"pool TWU {twu:.2f} over the soft limit {config.soft_limit_twu:.2f} (pressure {pressure:.0%}): "
                  "heavier models' shares shrink, none is refused")
    return AdmissionShares(shares, factors, reason)


__all__ = ["AdmissionShares", "DEFAULT_SCALE", "Direction", "SEED_004_WEIGHTS", "ScaleConfig", "ScaleSignal",
           "TwuSample", "admission_shares", "check_weights", "gear_twu_samples", "load_twu_samples", "model_weights",
           "parse_weights", "scale_signal", "window_mean"]
