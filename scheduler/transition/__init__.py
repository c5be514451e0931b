"""Gear transitions: the three-phase state machine (PREPARE -> SWITCH -> CLEANUP, or ROLLBACK).

A transition moves one deployment from its current gear (`from_gear`, None before its first
plan runs) to `to_gear`. It never drops or duplicates a request, never double-books a GPU and
survives the crash of any process at any step (DESIGN.md invariants 1-3; seed 000 sections
3.1-3.3, 4.3, 4.4 and 5.3). It is pure: no I/O, no wall clock. It talks to the world through
three ports (below) and is advanced by whoever holds them (a Celery task, a test, the
simulator), as often as they like: every call is idempotent.

Plans of the two gears fall into three sets: *new* plans (in to_gear only) are prepared,
*leaving* plans (in from_gear only) are drained and released, *kept* plans (in both, equal
content, hence equal plan_id) keep running and only see their routing weight change.

The transition table
--------------------

Forward steps, in order (`TABLE`). Each is keyed by (transition seq, step, attempt); every
effect carries that key, so running a step again re-issues the same commands, the same
reservation and the same routing commit, and nothing happens twice.

| phase   | step      | what it does                                                        | its undo (rollback step)   |
|---------|-----------|---------------------------------------------------------------------|----------------------------|
| PREPARE | reserve   | books the memory of the new plans' GPUs in the reservation ledger,  | rb_unreserve               |
|         |           | so no other plan or scheduler sees it (no agent is involved)        |                            |
| PREPARE | prepare   | `prepare_plan` to every node of every new plan: reserve the memory, | rb_abort (`abort_plan`,    |
|         |           | load the weights into the shadow plan, build its communication      | safe even if it never ran) |
|         |           | groups, warm up. No request reaches it yet                          |                            |
| SWITCH  | canary    | routing version +1: the new plans take `canary_share` of the new    | rb_route                   |
|         |           | requests while the old plans keep the rest; holds `canary_dwell_s`  |                            |
| SWITCH  | flip      | routing version +1, the atomic flip: every new request goes to the  | rb_route                   |
|         |           | target gear; leaving plans stay listed but frozen (weight 0)        |                            |
| SWITCH  | freeze    | `freeze_plan` to each leaving plan's leader: stop admitting; the    | rb_thaw (`thaw_plan`)      |
|         |           | ack lists its in-flight sequences                                   |                            |
| SWITCH  | move      | per sequence the cost model picks finish (stay on the old plan),    | rb_freeze + rb_move (hand  |
|         |           | migrate (KV over the link, bandwidth capped) or replay (re-prefill  | the sequences back)        |
|         |           | on the new plan); long sequences first, idle ones lazily;           |                            |
|         |           | `move_sequences` to each leaving plan's leader                      |                            |
| CLEANUP | unroute   | routing version +1 without the leaving plans (before they go: the   | - (roll forward)           |
|         |           | routing table never points at a released plan)                      |                            |
| CLEANUP | release   | `release_plan` to every node of the leaving plans: finish the       | - (roll forward)           |
|         |           | sequences left to finish (what cannot - drain timeout, lost GPUs -  |                            |
|         |           | is replayed on the target gear), then free the GPUs                 |                            |
| CLEANUP | unreserve | drops the leaving plans' reservations                               | - (roll forward)           |

The end of SWITCH is the commit point: until then ROLLBACK returns to `from_gear` (the last
stable gear); from CLEANUP on, `to_gear` is the stable gear and CLEANUP rolls forward
(failed steps are retried, then given up with the error recorded). ROLLBACK runs
`ROLLBACK_TABLE` in order; each step does nothing when its forward step never started:

| step         | what it does                                                                   |
|--------------|--------------------------------------------------------------------------------|
| rb_thaw      | `thaw_plan` to leaving plans that were frozen: they admit again                |
| rb_route     | routing version +1: the old gear's plans and weights; new plans frozen at 0    |
| rb_freeze    | `freeze_plan` to the new plans that were routed: their in-flight sequences     |
| rb_move      | `move_sequences` from the new plans back to the old ones (same cost model)     |
| rb_unroute   | routing version +1 without the new plans                                       |
| rb_abort     | `abort_plan` to every node of every new plan (a sequence still there ends with |
|              | an explicit error); safe for a plan that was never prepared                    |
| rb_unreserve | drops the new plans' reservations                                              |

Failures: a PREPARE step that fails or times out rolls back. A SWITCH step that fails, times
out or loses GPUs of the new plans (preemption) is retried `switch_retries` times (after
`retry_backoff_s`), then rolled back. CLEANUP and ROLLBACK steps are retried up to
`cleanup_attempts` times, then given up (ABANDONED, the error kept) so a transition always
ends. An operator's abort (emergency downshift) rolls back a transition in PREPARE or
SWITCH; one in CLEANUP or ROLLBACK finishes first.

Persistence (invariant 3): a step is saved as RUNNING, with everything it will do (its
commands, routing target, reservations), *before* any effect; effects carry a `Guard`
(deployment, seq, record version) and the ports refuse them once the record has moved on,
so a worker that woke up late cannot act for a step that someone else already finished or
rolled back. Every save is conditional on the version it read (`expected_version`).

Sequence ownership (invariant 2): every sequence holds a lease (plan_id, routing version).
A hand-over carries a new lease whose version is the routing version of the flip (or of
rb_route); the receiving engine accepts a sequence only when the lease is newer than the one
it had, and only at the end of a decode iteration (or while it is idle).

Crash points: the executor calls `probe(point)` after each save and each effect
(`crash_points()` lists them); tests and the Celery crash test stop the process there.
"""

from __future__ import annotations

from scheduler.booking import plan_memory  # listed here since before the split
from scheduler.plan import Stage  # listed here since before the split
from scheduler.transition.executor import Advance, Executor
from scheduler.transition.moves import MoveDirective, SeqInfo, lost_gpus, node_stages, plan_moves, plan_nodes
from scheduler.transition.ports import AgentPort, Clock, Probe, RoutingTable, TransitionStore
from scheduler.transition.ports import ModelResolver as ModelResolver
from scheduler.transition.ports import WeightsResolver as WeightsResolver
from scheduler.transition.records import (
    CommandIntent,
    CommandResult,
    Guard,
    Intent,
    MoveStats,
    Route,
    RoutingState,
    StaleGuard,
    StepRecord,
    TransitionEvent,
    TransitionRecord,
)
from scheduler.transition.records import CommandStatus as CommandStatus
from scheduler.transition.vocabulary import (
    ACTIVE_PHASES,
    CRASH_WHERE,
    DEFAULT_TRANSITION_CONFIG,
    PHASE_EDGES,
    ROLLBACK_TABLE,
    STEP_DEFS,
    TABLE,
    TERMINAL_PHASES,
    CommandKind,
    Kind,
    Phase,
    Step,
    StepDef,
    StepState,
    TransitionConfig,
    crash_points,
)
from scheduler.transition.vocabulary import Effect as Effect
from scheduler.transition.vocabulary import JsonDict as JsonDict

__all__ = [
    "ACTIVE_PHASES", "Advance", "AgentPort", "CRASH_WHERE", "Clock", "CommandIntent", "CommandKind",
    "CommandResult", "DEFAULT_TRANSITION_CONFIG", "Executor", "Guard", "Intent", "Kind", "MoveDirective",
    "MoveStats", "PHASE_EDGES", "Phase", "Probe", "ROLLBACK_TABLE", "Route", "RoutingState", "RoutingTable",
    "STEP_DEFS", "SeqInfo", "StaleGuard", "Stage", "Step", "StepDef", "StepRecord", "StepState", "TABLE",
    "TERMINAL_PHASES", "TransitionConfig", "TransitionEvent", "TransitionRecord", "TransitionStore",
    "crash_points", "lost_gpus", "node_stages", "plan_memory", "plan_moves", "plan_nodes",
]
