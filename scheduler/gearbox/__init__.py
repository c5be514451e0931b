"""The gear decision: gain against switch cost x hysteresis, cooldowns, triggers, overrides.

`decide(deployment, current_gear, snapshot, load_window, now_s)` is pure: the same inputs
give the same `Decision`, which records everything the console shows and audits (DESIGN.md
invariant 5): the trigger, every candidate with its estimated gain and cost, the hysteresis
factor, the outcome and the reasons.

Rules, in the order they apply:

1. EMERGENCY (operator): go to the baseline gear (or the gear the operator accepted instead,
   `requested_gear`) now - in any mode, cooldown or not; a running transition is superseded
   (the executor rolls it back first). Already there: STAY (idempotent). Not valid on this
   snapshot: BLOCKED, with why and what to do, and the planner's best safe gears as the
   candidates, best first (`safe_rank`: meets the SLOs, then the most goodput, then the fewest
   GPUs) - what an operator may accept as the emergency target instead.
2. MANUAL (operator, with a requested gear): switch to it if it is valid; no hysteresis or
   cooldown. Not while a transition runs (DEFERRED). Without a requested gear: STAY, with every
   feasible candidate the planner has now (best first by `safe_rank`, each with its estimate,
   gain and cost) - what an operator chooses a gear override from. Any mode.
3. Automatic triggers (PERIODIC, LOAD, TOPOLOGY):
   - PINNED and EMERGENCY deployments never switch automatically: STAY (or BLOCKED when the
     gear they hold is no longer valid - an operator must act);
   - never while a transition runs: DEFERRED;
   - current gear invalid on the snapshot (GPUs lost): move now to the best feasible
     candidate; hysteresis and cooldown do not apply to an infeasible gear;
   - no load samples in the windows and a valid gear: STAY (silence is not zero load);
   - within the cooldown after a switch: STAY (the cooldown is longer after two switches
     within `flap_window_s`: anti-flapping, seed 000 section 5.3). Only switches the gearbox
     chose count (`record_switch`): a forced move - off a gear that lost GPUs, or an
     emergency downshift - is being pushed, not flapping, and starts no cooldown. The cooldown
     is asymmetric: out of an overloaded gear (`overloaded`: the offered load at or above its
     capacity, its queue grows) an upshift - more modelled capacity - is weighed as below and
     nothing else is eligible; a downshift is held, so nothing flaps;
   - otherwise switch to the best candidate only if gain > cost x hysteresis and the gain
     per second is at least `min_relative_gain` of the offered output tokens/s.
   - a LOAD decision the control loop asks for more or less capacity (its TWU rule,
     `capacity_ask`) leaves out the candidates that go the other way (no more modelled
     capacity; no fewer GPUs) - not one that meets the SLOs the current gear misses.
   ADVISORY deployments get ADVISE where an AUTO one would SWITCH.
0. (before 1-3) The second stage of a staged switch whose first stage is done (`staged_target`):
   on to it without hysteresis or cooldown when it fits; pinned deployments stop there.

Memory across the switch (scheduler.booking, scheduler.staging): every candidate carries the
path that reaches it - direct when its new plans fit beside the current gear, else staged
through an intermediate candidate or a brief drain (priced as both switches plus the dwell, its
first stage being the decision's target), else blocked with what a full drain would take. An
operator's gear that does not fit goes the same way. Back-off (scheduler.backoff): while the
deployment backs off after refused PREPAREs automatic switches STAY, and backed-off plans are
never eligible. Plans a node's engine cannot run are never proposed (`Decision.excluded`).

Ranking. A candidate is *standing* when its estimate meets both SLOs at the offered load
with the headroom of the high watermark (`standing`). Standing candidates rank before the
others; a standing current gear is only left for another standing one (never trade the SLO
for GPUs); within a tier the larger gain beyond the threshold ranks first.

Gain and cost are in output tokens. The value of a gear per second is its goodput (output
tokens/s within the SLO) minus, once the SLOs are met, a rental charge per GPU it holds (a
share of the current gear's capacity per GPU - so among gears that meet the SLOs, one that
serves the same load with fewer GPUs is worth more). While the current gear misses its SLOs
no rent is charged in its gain: reaching the SLO is not traded against GPUs, and among the
standing candidates the one worth most after rent ranks first. Gain = (value_new -
value_old) x (horizon - time until the new gear carries the load). Cost =
`costmodel.switch_cost(...).tokens`. Out of an overloaded current gear (goodput 0: its queue
grows, and so does that of every candidate overloaded too) the gain per second is at least the
throughput the new gear serves beyond it - what it leaves unserved that the new gear takes on.

Load: `LoadWindow` holds samples; the offered load is the larger of the short- and
long-window means (never plan below a dip), plus the backlog: requests waiting at the end
of the newest sample count as arrivals spread over `backlog_drain_s`, so a gear that has
fallen behind looks as loaded as it is. The LOAD trigger is reported only when both windows
agree that the current gear is over its high watermark or under its low one, so one spike
does not move the gear - or when the caller passes it: the control loop does when both TWU
windows agree (its rule 11, with a `capacity_ask`).

Trend (`planned_load`, `GearboxConfig.trend`): while the long window's least-squares slope is a
significant rise, the load planned for is the line's forecast at now + `trend_lead_s` (up to a
cooldown: how long the gear chosen now must last) where that is above the level - never below
it, so a falling forecast never shrinks a gear; scale-in reads the level alone (and the control
loop's TWU rule holds it while the slope rises: `Planned.slope_t`). The Decision's `workload` is
the load planned for, and its first reason says when the trend raised it.

Modules: `values` (modes, triggers, the deployment, the knobs, load windows, the Decision and
its candidates), `measures` (offered load, cooldown, standing, the current gear, rankings), `weighing` (how one
decision prices a gear: gain, cost, path, back-off) and `decision` (`decide` and its named steps,
in the order of the rules above).
"""

from __future__ import annotations

from scheduler.gearbox.decision import decide
from scheduler.gearbox.measures import (
    Planned,
    cooldown_until,
    gear_footprint,
    margin_load,
    offered_load,
    overloaded,
    planned_load,
    record_switch,
    safe_rank,
    standing,
)
from scheduler.gearbox.values import (
    DEFAULT_CONFIG,
    CandidateEval,
    CapacityAsk,
    Decision,
    Deployment,
    GearboxConfig,
    LoadSample,
    LoadWindow,
    Mode,
    Outcome,
    Trend,
    Trigger,
)
from scheduler.gearbox.weighing import MAX_VIAS

__all__ = [
    "CandidateEval", "CapacityAsk", "DEFAULT_CONFIG", "Decision", "Deployment", "GearboxConfig", "LoadSample",
    "LoadWindow", "MAX_VIAS", "Mode", "Outcome", "Planned", "Trend", "Trigger", "cooldown_until", "decide",
    "gear_footprint", "margin_load", "offered_load", "overloaded", "planned_load", "record_switch", "safe_rank", "standing",
]
