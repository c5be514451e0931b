"""Every write to the registry goes through one of these actions (STYLE.md: `do_<verb>_<noun>`).

Each takes its actor, changes state in one transaction, appends the audit entry inside that same
transaction (both commit or neither) and notifies the browsers in `transaction.on_commit`.
Refusals raise `Refused` naming each offending field, before anything is written.

Reading a weights file happens *before* the transaction that records its digest: no database
lock is held while gigabytes stream through SHA256.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit.chain import actor_of, record
from console.registry import live
from console.registry.architecture import validate_architecture
from console.registry.models import ModelVersion
from console.registry.weights import SHA256_RE, check_readable_file, confined, parse_weights_uri, sha256_file

log = logging.getLogger(__name__)
REGISTRY_ACTOR = actor_of(system="registry")
VERIFY_COMMAND = "verify_weights"


class Refused(Exception):
    """A registry write refused. `errors` names each offending field; nothing was written."""

    def __init__(self, status: int, errors: dict[str, str]) -> None:
        self.status = status
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


@dataclass(frozen=True)
class VersionSpec:
    """What an admin registers (the API's request body, already type-checked)."""

    name: str
    version: str
    engine: str  # vllm | torch
    architecture: str | dict[str, Any]  # catalog name or Hugging Face config
    weights_uri: str
    sha256: str  # 64 lowercase hex
    tokenizer: str
    max_context: int
    min_gpu_mem_bytes: int
    warmup_tokens: int


@dataclass(frozen=True)
class Registration:
    version: ModelVersion
    created: bool  # False when the identical version was registered before (idempotent repeat)


def sync_verify_limit_bytes() -> int:
    """Local files up to this size are hashed during the request; bigger ones by a Celery task."""
    return int(settings.FLEXPIPE_REGISTRY_SYNC_VERIFY_BYTES)


def _existing_conflicts(spec: VersionSpec) -> tuple[ModelVersion | None, dict[str, str]]:
    same = ModelVersion.objects.filter(name=spec.name, version=spec.version).first()
    if same is not None:
        if same.sha256 != spec.sha256:
            return same, {"sha256": (
                f"{spec.name} {spec.version} is registered with sha256 {same.sha256}; other weights are "
                "another entity: register them under a new version")}
        differs = {key: (f"differs from the registered {spec.name} {spec.version}; a version never changes, "
                         "register a new version instead")
                   for key, value in asdict(spec).items() if getattr(same, key) != value}
        return same, differs
    twin = ModelVersion.objects.filter(name=spec.name, sha256=spec.sha256).first()
    if twin is not None:
        return None, {"sha256": f"these weights are already registered as {twin.name} {twin.version}"}
    return None, {}


def tokenizer_problem(tokenizer: str, roots: list[Path]) -> str | None:
    """Why the gateway could not tokenize with this version's tokenizer (a tokenizer.json or the model
    folder holding one, under a model root), or None: it is loaded and tried now, at registration."""
    from console.gateway import tokens

    if not tokenizer.startswith("/"):
        return "must be the absolute path of a tokenizer.json (or of the model folder holding one) under a model root"
    try:
        path = confined(Path(tokenizer), roots)
        tok = tokens.load(str(path))
        ids = tok.encode("FlexPipe registry check")
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        return f"{tokenizer} does not load as a tokenizer ({exc.__class__.__name__}: {exc})"[:400]
    if not ids:
        return f"{tokenizer} encodes text to no tokens"
    return None


def do_register_model_version(spec: VersionSpec, *, actor: str, user: Any | None = None,
                              now: datetime | None = None) -> Registration:
    """Register a version; verify its weights now (small local file), later (big local file: Celery
    task `registry.verify_weights`) or when an agent loads them (remote URI).

    Registering the identical version again returns it unchanged (created=False); the same name and
    version with other weights, or other fields, is refused (409) naming the field.
    """
    now = now or timezone.now()
    if not SHA256_RE.fullmatch(spec.sha256):
        raise Refused(400, {"sha256": "must be 64 lowercase hexadecimal digits"})
    errors: dict[str, str] = {}
    try:
        arch = validate_architecture(spec.architecture)
        if arch.max_context_tokens is not None and spec.max_context > arch.max_context_tokens:
            errors["max_context"] = (f"{spec.max_context} exceeds the architecture's limit of "
                                     f"{arch.max_context_tokens} tokens")
        spec = VersionSpec(**{**asdict(spec), "architecture": arch.value})
    except ValueError as exc:
        errors["architecture"] = str(exc)
    roots = list(settings.FLEXPIPE_MODEL_ROOTS)
    try:
        location = parse_weights_uri(spec.weights_uri)
        if location.local_path is not None:
            location = replace(location, local_path=confined(location.local_path, roots))
    except ValueError as exc:
        errors["weights_uri"] = str(exc)
        location = None
    problem = tokenizer_problem(spec.tokenizer, roots)
    if problem is not None:
        errors["tokenizer"] = problem
    if errors:
        raise Refused(400, errors)

    existing, conflicts = _existing_conflicts(spec)
    if conflicts:
        raise Refused(409, conflicts)
    if existing is not None:
        return Registration(existing, created=False)

    size: int | None = None
    observed: str | None = None
    assert location is not None  # noqa: S101 - errors were raised above otherwise
    if location.local_path is not None:
        try:
            size = check_readable_file(location.local_path)
            if size <= sync_verify_limit_bytes():
                observed = sha256_file(location.local_path)
        except ValueError as exc:
            raise Refused(400, {"weights_uri": str(exc)}) from None
        except OSError as exc:
            raise Refused(400, {"weights_uri": f"cannot read {location.local_path}: {exc.strerror or exc}"}) from None
    return _register(spec, local=location.is_local, size=size, observed=observed, actor=actor, user=user, now=now)


@transaction.atomic
def _register(spec: VersionSpec, *, local: bool, size: int | None, observed: str | None, actor: str,
              user: Any | None, now: datetime) -> Registration:
    status = ModelVersion.VERIFYING if local else ModelVersion.AWAITING_AGENT
    detail = ("hashing the local weights file" if local
              else "remote weights: the first agent that loads them checks the digest")
    try:
        with transaction.atomic():  # a savepoint: a concurrent twin registration loses cleanly
            version = ModelVersion.objects.create(
                **asdict(spec), status=status, status_detail=detail, weights_bytes=size, registered_at=now,
                registered_by=actor)
    except IntegrityError:
        existing, conflicts = _existing_conflicts(spec)
        if existing is not None and not conflicts:
            return Registration(existing, created=False)
        raise Refused(409, conflicts or {"name": "registered concurrently by another request; retry"}) from None
    record("registry.version_registered", actor=actor, user=user, at=now,
           summary=f"{spec.name} {spec.version} registered ({spec.engine}, sha256 {spec.sha256[:12]}…), {status}",
           data={**asdict(spec), "id": version.pk, "weights_bytes": size},
           after={"status": status})
    if observed is not None:
        _apply_check(version, observed=observed, actor=REGISTRY_ACTOR, node_id=None, now=now)  # pushes it
        return Registration(version, created=True)
    if local:
        transaction.on_commit(lambda: _enqueue_verification(version.pk))
    transaction.on_commit(lambda: live.push_version(version.pk))
    return Registration(version, created=True)


def _enqueue_verification(version_id: int) -> None:
    from console.celery import enqueue
    from console.registry.tasks import verify_weights

    # A broker outage must not turn a committed registration into a 500: the version says verifying
    # and the task is sent when the broker answers again (console.celery.enqueue).
    enqueue(verify_weights, version_id=version_id)


@dataclass(frozen=True)
class CheckResult:
    version: ModelVersion
    matched: bool
    changed: bool  # the status moved (verified or quarantined)


def _who(actor: str, node_id: str | None) -> str:
    return f"agent {node_id}" if node_id else actor


def _apply_check(version: ModelVersion, *, observed: str, actor: str, node_id: str | None,
                 now: datetime) -> CheckResult:
    """Apply one observed digest to a locked (or freshly created) version. Caller holds the transaction."""
    matched = observed == version.sha256
    before = version.status
    if before not in ModelVersion.CHECKABLE:
        if before == ModelVersion.QUARANTINED:
            # The status stays (only an admin ends a quarantine, by retiring it), but the evidence is kept.
            record("registry.weights_checked", actor=actor, at=now, deployment="",
                   summary=f"{version.name} {version.version}: {_who(actor, node_id)} observed "
                           f"{'the registered' if matched else 'another'} digest; stays quarantined",
                   data={"id": version.pk, "node_id": node_id, "observed_sha256": observed,
                         "expected_sha256": version.sha256, "matched": matched})
        return CheckResult(version, matched, changed=False)
    if matched:
        if before == ModelVersion.VERIFIED:
            return CheckResult(version, True, changed=False)  # a repeated confirmation changes nothing
        version.status = ModelVersion.VERIFIED
        version.status_detail = f"sha256 matched ({_who(actor, node_id)})"
        version.verified_at = now
        version.verified_by = actor
        version.save(update_fields=["status", "status_detail", "verified_at", "verified_by"])
        record("registry.weights_verified", actor=actor, at=now,
               summary=f"{version.name} {version.version}: weights verified by {_who(actor, node_id)}",
               data={"id": version.pk, "node_id": node_id, "sha256": observed},
               before={"status": before}, after={"status": version.status})
    else:
        _quarantine(version, observed=observed, actor=actor, now=now,
                    detail=f"{_who(actor, node_id)} observed sha256 {observed}, registered {version.sha256}",
                    data={"node_id": node_id, "expected_sha256": version.sha256, "observed_sha256": observed,
                          "weights_uri": version.weights_uri})
    transaction.on_commit(lambda: live.push_version(version.pk))
    return CheckResult(version, matched, changed=True)


def _quarantine(version: ModelVersion, *, observed: str, actor: str, now: datetime, detail: str,
                data: dict[str, Any]) -> None:
    before = {"status": version.status, "observed_sha256": version.observed_sha256}
    version.status = ModelVersion.QUARANTINED
    version.status_detail = detail[:500]
    version.observed_sha256 = observed
    version.quarantined_at = now
    version.quarantined_by = actor
    version.save(update_fields=["status", "status_detail", "observed_sha256", "quarantined_at", "quarantined_by"])
    record("registry.version_quarantined", actor=actor, at=now,
           summary=f"{version.name} {version.version} quarantined: {detail}"[:300],
           data={"id": version.pk, **data},
           before=before, after={"status": version.status, "observed_sha256": observed})


@transaction.atomic
def do_record_weights_check(version: ModelVersion, *, observed_sha256: str, node_id: str | None = None,
                            actor: str | None = None, now: datetime | None = None) -> CheckResult:
    """An observed SHA256 of a version's weights: by an agent before it loads them, or by the console.

    Match: verifying/awaiting_agent -> verified. Mismatch: -> quarantined, audited with before/after.
    A quarantined version stays quarantined; a retired one ignores reports.
    """
    observed = observed_sha256.strip().lower() if isinstance(observed_sha256, str) else ""
    if not SHA256_RE.fullmatch(observed):
        raise Refused(400, {"sha256": f"must be 64 hexadecimal digits; got {observed_sha256!r:.80}"})
    actor = actor or (actor_of(agent=node_id) if node_id else REGISTRY_ACTOR)
    locked = ModelVersion.objects.select_for_update().get(pk=version.pk)
    return _apply_check(locked, observed=observed, actor=actor, node_id=node_id, now=now or timezone.now())


@transaction.atomic
def do_record_weights_check_failure(version: ModelVersion, *, node_id: str, detail: str,
                                    now: datetime | None = None) -> None:
    """An agent could not check the weights (download failed, say): recorded; the status stays."""
    now = now or timezone.now()
    record("registry.weights_check_failed", actor=actor_of(agent=node_id), at=now,
           summary=f"{version.name} {version.version}: agent {node_id} could not check the weights: {detail}"[:300],
           data={"id": version.pk, "node_id": node_id, "detail": detail[:1000]})


@transaction.atomic
def do_quarantine_model_version(version: ModelVersion, *, reason: str, actor: str,
                                now: datetime | None = None) -> bool:
    """Quarantine a version whose weights cannot be verified. True when the status changed."""
    locked = ModelVersion.objects.select_for_update().get(pk=version.pk)
    if locked.status not in ModelVersion.CHECKABLE:
        return False
    _quarantine(locked, observed="", actor=actor, now=now or timezone.now(), detail=reason,
                data={"reason": reason, "weights_uri": locked.weights_uri})
    transaction.on_commit(lambda: live.push_version(locked.pk))
    return True


def verify_local_weights(version_id: int, *, now: datetime | None = None) -> str:
    """Hash a `verifying` version's local file and record the outcome; returns the resulting status.

    Idempotent: a version that is no longer `verifying` (done before, retired meanwhile) is left as it is.
    """
    version = ModelVersion.objects.filter(pk=version_id).first()
    if version is None:
        return "missing"
    if version.status != ModelVersion.VERIFYING:
        return version.status
    location = parse_weights_uri(version.weights_uri)
    if location.local_path is None:
        return version.status  # not ours to hash: an agent reports it
    try:
        path = confined(location.local_path, list(settings.FLEXPIPE_MODEL_ROOTS))
        check_readable_file(path)
        observed = sha256_file(path)
    except (ValueError, OSError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"cannot read {location.local_path}: {exc.strerror or exc}"
        do_quarantine_model_version(version, reason=f"weights unreadable, cannot be verified: {reason}",
                                    actor=REGISTRY_ACTOR, now=now)
    else:
        do_record_weights_check(version, observed_sha256=observed, actor=REGISTRY_ACTOR, now=now)
    return ModelVersion.objects.values_list("status", flat=True).get(pk=version_id)


@transaction.atomic
def do_retire_model_version(version: ModelVersion, *, actor: str, user: Any | None = None, reason: str = "",
                            now: datetime | None = None) -> bool:
    """Take a version out of service. Idempotent: retiring a retired version changes nothing (False)."""
    now = now or timezone.now()
    locked = ModelVersion.objects.select_for_update().get(pk=version.pk)
    if locked.status == ModelVersion.RETIRED:
        return False
    from console.gearbox.models import ACTIVE_PHASES, Transition

    serving = sorted(locked.deployments.values_list("name", flat=True))
    rolling = sorted(Transition.objects.filter(model_version=locked, phase__in=ACTIVE_PHASES)
                     .values_list("deployment__name", flat=True))
    if serving or rolling:
        who = ", ".join(serving + [f"{n} (rolling it out)" for n in rolling])
        raise Refused(409, {"status": f"{locked.name} {locked.version} is in use by {who}: roll another version "
                                      "out first"})
    before = locked.status
    locked.status = ModelVersion.RETIRED
    locked.status_detail = f"retired: {reason}" if reason else "retired"
    locked.retired_at = now
    locked.retired_by = actor
    locked.save(update_fields=["status", "status_detail", "retired_at", "retired_by"])
    record("registry.version_retired", actor=actor, user=user, at=now,
           summary=f"{locked.name} {locked.version} retired" + (f": {reason}" if reason else ""),
           data={"id": locked.pk, "reason": reason}, before={"status": before}, after={"status": locked.status})
    transaction.on_commit(lambda: live.push_version(locked.pk))
    return True


def do_request_weights_check(version: ModelVersion, node: Any, *, actor: str, now: datetime | None = None) -> Any:
    """Ask one node's agent to hash this version's weights (before it loads them) and ack with the digest.

    The command's ack result `{"sha256": "<hex>"}` comes back through `console.fleet.signals.command_acked`
    (see receivers.py). The command key is per (version, node): asking again returns the same command.
    A retired version is out of service: asking about it is refused (409, naming `status`).
    """
    from console.fleet.actions import do_issue_command
    from console.fleet.models import AgentCommand

    now = now or timezone.now()
    key = f"registry.{VERIFY_COMMAND}:{version.pk}:{node.node_id}"
    with transaction.atomic():
        version = ModelVersion.objects.select_for_update().get(pk=version.pk)  # a concurrent retire waits
        if version.status == ModelVersion.RETIRED:
            raise Refused(409, {"status": f"{version.name} {version.version} is retired: its weights are no "
                                          "longer checked"})
        asked_before = AgentCommand.objects.filter(key=key).exists()
        cmd = do_issue_command(
            node, key=key, kind=VERIFY_COMMAND, now=now,
            payload={"model_version_id": version.pk, "name": version.name, "version": version.version,
                     "weights_uri": version.weights_uri, "sha256": version.sha256, "engine": version.engine,
                     "tokenizer": version.tokenizer})
        if not asked_before:
            record("registry.weights_check_requested", actor=actor, at=now,
                   summary=f"{version.name} {version.version}: asked agent {node.node_id} to check the weights",
                   data={"id": version.pk, "node_id": node.node_id, "command_id": cmd.pk})
    return cmd
