"""Celery tasks of the gearbox: thin, idempotent, ids not objects (STYLE.md).

    gearbox.tick          beat every FLEXPIPE_TICK_S, and at once on a topology event
                          (console.fleet.signals.topology_changed; merged with the events of
                          a short window, console.gearbox.coalesce), an emergency request, and
                          when a transition ends: decide for every deployment (ticks.tick)
    transitions.advance   on every ack of a transition's command (console.fleet.signals.
                          command_acked), when a transition starts, and when the sweep finds it
                          due: take every step that can be taken now (executor.advance)
    gearbox.correct       beat every FLEXPIPE_GLOBAL_LOOP_S: the global correction's hints to the
                          engines (correction.correct); not acks_late, and expiring after two
                          periods: a run lost or late is replaced by the next one
    transitions.sweep     beat every FLEXPIPE_SWEEP_S: advance every active transition, so a
                          step's timeout, a canary's dwell or a retry's back-off is noticed, and a
                          transition whose worker died (SIGKILL) resumes on another

acks_late=True only because each body is idempotent: running one twice, or after a crash
half way through, does what running it once does (conditional saves, keyed commands).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import shared_task

from console.celery import enqueue
from console.gearbox import coalesce, correction, executor, ticks
from console.gearbox.models import ACTIVE_PHASES, Transition

log = logging.getLogger(__name__)
SHORT_WAIT_S = 10.0  # a dwell or back-off shorter than this is woken by a countdown, not the sweep
__all__ = ["advance", "correct", "enqueue", "sweep", "tick"]


RETICK_S = 1.0  # a deployment waiting for its agents' reports is decided again this soon


@shared_task(name="gearbox.tick", acks_late=True)
def tick(trigger: str = "periodic", deployment: str | None = None, **kwargs: Any) -> dict[str, object]:
    coalesce.started(trigger, deployment)  # before it reads the fleet: a later event gets a tick of its own
    out = ticks.tick(trigger=trigger, deployment=deployment)
    # a decision put off until the agents' reports catch up is taken as soon as they do, not at
    # the next beat (the wait is bounded: control.reports_mirror_last_transition)
    waiting = out.get("waiting") or []
    for name in waiting if isinstance(waiting, list) else []:  # one pending re-tick per deployment
        coalesce.request_tick(tick, trigger=trigger, deployment=name, countdown_s=RETICK_S)
    return out


@shared_task(name="gearbox.correct")
def correct(**kwargs: Any) -> dict[str, object]:
    return correction.correct()


@shared_task(name="transitions.advance", acks_late=True)
def advance(deployment: str, seq: int | None = None, **kwargs: Any) -> dict[str, object]:
    out = executor.advance(deployment, seq)
    rec = out.record
    if out.finished:
        enqueue(tick, trigger="ended", deployment=deployment)
    elif rec is not None and rec.active and out.wake_at_s is not None and not out.waiting_for:
        delay = out.wake_at_s - time.time()
        if 0 < delay < SHORT_WAIT_S:
            enqueue(advance, countdown=delay + 0.05, deployment=deployment, seq=rec.seq)
    return {"deployment": deployment, "seq": rec.seq if rec else None, "phase": rec.phase.value if rec else None,
            "step": rec.current.step.value if rec and rec.current else None, "finished": out.finished}


@shared_task(name="transitions.sweep", acks_late=True)
def sweep(**kwargs: Any) -> list[str]:
    active = list(Transition.objects.filter(phase__in=ACTIVE_PHASES).select_related("deployment")
                  .values_list("deployment__name", "seq"))
    for name, seq in active:
        enqueue(advance, deployment=name, seq=seq)
    return [f"{name}#{seq}" for name, seq in active]
