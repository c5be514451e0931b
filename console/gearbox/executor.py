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
from console.registry.specs import spec_for
from scheduler.transition import Advance, Executor, TransitionConfig, TransitionRecord


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


def version_load(rec: TransitionRecord) -> dict[str, object] | None:
    """What the new plans of a transition load: the registry version the transition row names (the
    deployment's own at its start, or the one a rollout rolls out), its SHA-256 - the agent refuses
    other weights, even for a quarantined version: never loaded unchecked - and what the agent checks
    on the shadow plan (tokenizer, warm-up); and the deployment's SLO, which a simulated agent runs a
    deployment it was not configured with by (agents/protocol/, prepare_plan). No weights digest nor
    model_version: the deployment has no registry version; None: no such transition row."""
    row = (Transition.objects.filter(deployment__name=rec.deployment_id, seq=rec.seq)
           .select_related("model_version", "deployment__model_version").first())
    if row is None:
        return None
    out: dict[str, object] = {"slo": {"ttft_ms": row.deployment.ttft_ms, "tpot_ms": row.deployment.tpot_ms}}
    version = row.model_version or row.deployment.model_version
    if version is None:
        return out
    out.update({"weights_sha256": version.sha256,
                "model_version": {"id": version.pk, "version": version.version, "tokenizer": version.tokenizer,
                                  "warmup_tokens": version.warmup_tokens, "max_context": version.max_context}})
    return out


def build_executor(*, actor: str = "system:transitions") -> Executor:
    # models: a registered model outside the built-in catalog is sized from its config.json (its
    # plans' memory, the KV it books) as the planner sized it (console/registry/specs.py); every
    # prepare_plan carries that spec (model_spec) and version_load's slo, so a simulated agent
    # runs a deployment created in the console as the console sized it
    return Executor(DjangoStore(actor=actor), DjangoAgentPort(), DjangoRouting(actor=actor), time.time,
                    config=transition_config(), probe=crashpoints.probe, weights=version_load, models=spec_for)


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
