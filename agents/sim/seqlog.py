"""The simulator's per-sequence event log: who owns each request, for invariants 1 and 2.

When a `FleetSim` has an event log (`sim.events`: the live fleet's, a test's, or a replay's
`scheduler.invariants.CheckingLog`), every request's life goes to it as the events
`scheduler.invariants.check` reads - the same ones the transition tests' worlds write:

* seq_admitted: the gateway (or the workload) took it;
* seq_assigned: a plan owns it, under the lease (routing version) it was routed with;
* seq_paused: its owner stopped it at a safe boundary - the end of the round in flight
  (`decode_end`), or while it waited (`idle`) - to hand it over;
* seq_handover: a paused sequence moved to another plan with a newer lease (a transition's
  move_sequences, or a re-route after a routing commit);
* seq_returned: its owner gave it back to the router without such a lease - the plan stopped
  (GPUs lost, aborted, released past its drain: its KV is gone) or a policy that keeps no
  routing versions re-routed it; then no plan owns it until it is assigned again;
* seq_decoded: its owner ran decode rounds of it (one event per credited run of rounds; only
  when the log records decodes - `EventLog(record_decodes=True)`: a replay's CheckingLog and the
  live fleet's log leave them out);
* seq_finished (by the plan whose engine ran its last token), seq_failed (with the reason).

Ownership changes are seen where a request arrives: `owns` is called by `PlanEngine.submit` and
`PlanEngine.expect` (every way into an engine), `paused` by whoever takes sequences off a pipe
at its boundary, `unowned` when a request goes back to the deployment's queue. Nothing here
changes what the simulator does; without a log every call returns at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.invariants import EventLog, LogEvent

if TYPE_CHECKING:
    from agents.sim.engine import PlanEngine, Request


def owns(log: EventLog, req: Request, engine: PlanEngine, t: float, node: str = "") -> None:
    """`req` arrives on `engine` (routed, handed over, or back on its own plan)."""
    if req.owner_engine == engine.engine_id:
        return  # its own plan (a disaggregated hand-off between its pipes, a requeue)
    plan = engine.plan.plan_id
    sid = str(req.rid)
    if req.owner and req.paused_on == req.owner and req.lease > req.owner_lease:
        log.add(LogEvent(t, "seq_handover", deployment=req.deployment, seq_id=sid, plan_id=req.owner,
                         to_plan=plan, version=req.lease, boundary=req.paused_at))
    else:
        if req.owner:
            _returned(log, req, t)
        log.add(LogEvent(t, "seq_assigned", deployment=req.deployment, seq_id=sid, plan_id=plan,
                         version=req.lease, node=node))
    req.owner, req.owner_engine, req.owner_lease, req.paused_on = plan, engine.engine_id, req.lease, ""


def paused(log: EventLog, req: Request, t: float, boundary: str) -> None:
    """Its owner stopped `req` at a safe boundary (`decode_end` or `idle`) to hand it over."""
    if not req.owner or req.paused_on == req.owner:
        return
    req.paused_on, req.paused_at = req.owner, boundary
    log.add(LogEvent(t, "seq_paused", deployment=req.deployment, seq_id=str(req.rid), plan_id=req.owner,
                     boundary=boundary))


def unowned(log: EventLog, req: Request, t: float) -> None:
    """`req` waits in its deployment's queue: whoever owned it gave it back."""
    if req.owner:
        _returned(log, req, t)
        req.owner, req.owner_engine, req.paused_on = "", 0, ""


def _returned(log: EventLog, req: Request, t: float) -> None:
    why = ("paused for a hand-over, then re-routed without a newer lease" if req.paused_on == req.owner
           else "its plan stopped with it (KV gone): recomputed where the router sends it")
    log.add(LogEvent(t, "seq_returned", deployment=req.deployment, seq_id=str(req.rid), plan_id=req.owner,
                     detail=why))


__all__ = ["owns", "paused", "unowned"]
