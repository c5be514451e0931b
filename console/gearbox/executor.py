"""The transition executor wired to the Django ports, and one call to advance a transition.

Settings (environment, console/settings.py): FLEXPIPE_CANARY_SHARE, FLEXPIPE_CANARY_DWELL_S,
FLEXPIPE_DRAIN_BUDGET_S, FLEXPIPE_PREPARE_TIMEOUT_S, FLEXPIPE_STEP_TIMEOUT_S,
FLEXPIPE_MOVE_TIMEOUT_S, FLEXPIPE_RETRY_BACKOFF_S: see scheduler.transition.TransitionConfig.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from django.conf import settings

from console.gearbox import crashpoints
from console.gearbox.models import Transition
from console.gearbox.ports import DjangoAgentPort, DjangoRouting, DjangoStore
from scheduler.transition import Advance, Executor, TransitionConfig


def transition_config() -> TransitionConfig:
    return TransitionConfig(
        canary_share=settings.FLEXPIPE_CANARY_SHARE,
        canary_dwell_s=settings.FLEXPIPE_CANARY_DWELL_S,
        drain_budget_s=settings.FLEXPIPE_DRAIN_BUDGET_S,
        prepare_timeout_s=settings.FLEXPIPE_PREPARE_TIMEOUT_S,
        step_timeout_s=settings.FLEXPIPE_STEP_TIMEOUT_S,
        move_timeout_s=settings.FLEXPIPE_MOVE_TIMEOUT_S,
        retry_backoff_s=settings.FLEXPIPE_RETRY_BACKOFF_S,
    )


def registry_weights(model: str) -> str | None:
    """The SHA-256 of the weights prepare_plan loads: the model's newest version in the registry
    that may be loaded (verified, or awaiting the first agent's hash). With none but a quarantined
    one, that one's registered digest: an agent then refuses weights other than the registered ones
    instead of loading them unchecked (a quarantined version's wrong weights are never loaded).
    None when the registry holds no such version (an unregistered model: nothing to check against)."""
    from console.registry.models import ModelVersion

    newest = ("-registered_at", "-id")
    loadable = ModelVersion.objects.filter(name=model, status__in=(ModelVersion.VERIFIED, ModelVersion.AWAITING_AGENT))
    digest = loadable.order_by(*newest).values_list("sha256", flat=True).first()
    if digest is None:
        digest = ModelVersion.objects.filter(name=model, status=ModelVersion.QUARANTINED).order_by(*newest) \
            .values_list("sha256", flat=True).first()
    return digest


def registry_warmup(model: str) -> int:
    """Tokens a new plan of `model` generates before it is served: the registry's `warmup_tokens`
    of the version prepare_plan loads (registry_weights' choice); 1 for a model it does not hold."""
    from console.registry.models import ModelVersion

    digest = registry_weights(model)
    if digest is None:
        return 1
    found = ModelVersion.objects.filter(name=model, sha256=digest).order_by("-registered_at", "-id") \
        .values_list("warmup_tokens", flat=True).first()
    return int(found) if found is not None else 1


def build_executor(*, actor: str = "system:transitions") -> Executor:
    return Executor(DjangoStore(actor=actor), DjangoAgentPort(), DjangoRouting(actor=actor), time.time,
                    config=transition_config(), probe=crashpoints.probe, weights=registry_weights,
                    warmup=registry_warmup)


def advance(deployment: str, seq: int | None = None) -> Advance:
    """Take every step that can be taken now; remember when to look again (the sweep's wake_at)."""
    out = build_executor().advance(deployment, seq)
    rec = out.record
    if rec is not None and rec.active:
        wake = datetime.fromtimestamp(out.wake_at_s, tz=UTC) if out.wake_at_s is not None else None
        Transition.objects.filter(deployment__name=deployment, seq=rec.seq).update(wake_at=wake)
    elif rec is not None:
        Transition.objects.filter(deployment__name=deployment, seq=rec.seq).update(wake_at=None)
    return out
