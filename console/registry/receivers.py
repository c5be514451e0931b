"""The agent's side of weight verification: the ack of a `verify_weights` command carries the digest.

    command  kind "verify_weights", payload {"model_version_id", "weights_uri", "sha256", ...}
    ack      {"status": "ok", "result": {"sha256": "<64 hex, what the agent computed>"}}
             or {"status": "failed", "detail": "why it could not hash them"}

The fleet sends `command_acked` on commit of the ack; this receiver turns it into
`do_record_weights_check` (match -> verified, mismatch -> quarantined), in its own transaction.

The same holds for a `prepare_plan` ack: the agent hashes the weights before loading them and
reports the digest (agents/protocol/), so a remote version is checked by every agent that loads it.
"""

from __future__ import annotations

import logging
from typing import Any

from console.fleet.signals import command_acked

log = logging.getLogger(__name__)
PREPARE_COMMAND = "prepare_plan"


def on_command_acked(sender: Any, command: Any, **kwargs: Any) -> None:
    from console.audit.chain import actor_of, record
    from console.registry import actions
    from console.registry.models import ModelVersion

    if command.kind == PREPARE_COMMAND and command.state in ("ok", "failed"):
        on_prepare_acked(command)
        return
    if command.kind != actions.VERIFY_COMMAND or command.state not in ("ok", "failed"):
        return
    node_id = command.node.node_id
    version_id = command.payload.get("model_version_id")
    version = ModelVersion.objects.filter(pk=version_id).first() if isinstance(version_id, int) else None
    if version is None:
        log.warning("verify_weights ack %s names no known model version (%r)", command.pk, version_id)
        return
    observed = (command.result or {}).get("sha256")
    if observed is None:
        detail = command.detail or "the ack carried no sha256"
        actions.do_record_weights_check_failure(version, node_id=node_id, detail=detail)
        return
    try:
        actions.do_record_weights_check(version, observed_sha256=observed, node_id=node_id)
    except actions.Refused as exc:
        # The ack is stored already; the malformed digest is recorded, the status stays.
        from django.utils import timezone

        record("registry.weights_check_invalid", actor=actor_of(agent=node_id), at=timezone.now(),
               summary=f"{version.name} {version.version}: agent {node_id} acked with an unusable digest",
               data={"id": version.pk, "node_id": node_id, "command_id": command.pk, "error": str(exc)})


def on_prepare_acked(command: Any) -> None:
    """A prepare_plan ack carries the digest the agent computed before loading the weights (ok: they
    matched the registry's and were loaded; failed: other weights, not loaded). Either is the agent's
    check of that version: a match verifies it, a mismatch quarantines it (audited)."""
    from console.registry import actions
    from console.registry.models import ModelVersion

    payload = command.payload if isinstance(command.payload, dict) else {}
    result = command.result if isinstance(command.result, dict) else {}
    expected, observed, model = payload.get("weights_sha256"), result.get("weights_sha256"), payload.get("model")
    if not (isinstance(expected, str) and isinstance(observed, str) and isinstance(model, str)):
        return  # no registry digest asked for, or the agent hashed nothing: nothing to record
    version = ModelVersion.objects.filter(name=model, sha256=expected).first()
    if version is None:
        log.warning("prepare_plan ack %s names weights %s of %r the registry does not hold", command.pk,
                    expected[:12], model)
        return
    try:
        actions.do_record_weights_check(version, observed_sha256=observed, node_id=command.node.node_id)
    except actions.Refused as exc:  # check_result refuses such acks already; kept for failed ones
        log.warning("prepare_plan ack %s: unusable weights digest (%s)", command.pk, exc)


def connect() -> None:
    command_acked.connect(on_command_acked, dispatch_uid="registry.verify_weights_ack")
