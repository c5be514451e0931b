"""A job's runner speaks for its job, and for nothing else (issue 17 deliverable 5).

A fine-tune or batch job runs outside FlexPipe. Its runner reads its job (where it runs, whether
to yield, by when) and acknowledges its checkpoints. Before, only an operator's token could do
the acknowledging, so a runner had to carry an operator's credential: one that could also steer
every gear in the pool. Now each job has a runner token of its own, as each agent has its agent
token (console/fleet/actions.py):

* `POST /api/v1/jobs` answers the new job with `runner_token` (`fpr_...`), once; the console
  keeps only its SHA-256. An operator issues a new one with
  `POST /api/v1/jobs/<name>/runner-token`, and the old one stops working at once (audited).
* `Authorization: Bearer fpr_...` is honoured on the job's own two paths:
  `GET /api/v1/jobs/<name>` and `POST /api/v1/jobs/<name>/checkpointed`. On another job it is a
  403. Anywhere else it is no credential at all: a 401 as for any unknown token, because only
  JobViewSet puts `JobRunnerAuthentication` first in its list.
* The audit names the runner as the actor: `runner:<job>`.

The principal a runner token authenticates as holds no role (console/accounts/roles.role_of
gives None), so the role permissions refuse it everywhere. Only `IsJobRunner` lets it in, and
only for the job whose name is in the path.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.db import transaction
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from console.accounts.auth import hash_token
from console.audit.chain import record
from console.gearbox.actions import _who
from console.gearbox.models import Job

TOKEN_PREFIX = "fpr_"


def new_runner_token() -> tuple[str, str]:
    """(a fresh runner token, its hash): the token is shown once, the hash kept on the job."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


class RunnerPrincipal:
    """request.user for a runner token: authenticated, and no role (module docstring)."""

    is_authenticated = True
    is_active = True
    is_superuser = False
    is_staff = False
    pk = None

    def __init__(self, job: str) -> None:
        self.job = job
        self.username = runner_actor(job)

    def get_username(self) -> str:
        return self.username


def runner_actor(job: str) -> str:
    """The audit actor of a job's runner."""
    return f"runner:{job}"


class JobRunnerAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer fpr_...`: a job's runner (module docstring). Other tokens are left to
    the next authentication class."""

    def authenticate(self, request: Any) -> tuple[RunnerPrincipal, Job] | None:
        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token.startswith(TOKEN_PREFIX):
            return None
        job = Job.objects.filter(runner_token_hash=hash_token(token)).order_by().first()
        if job is None:
            raise exceptions.AuthenticationFailed("Authorization: unknown job runner token (a new one replaces it)")
        return RunnerPrincipal(job.name), job

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="api"'


class IsJobRunner(permissions.BasePermission):
    """The runner of the job named in the path."""

    message = "a job runner's token is valid for its own job only"

    def has_permission(self, request: Any, view: Any) -> bool:
        job = request.auth
        return isinstance(job, Job) and view.kwargs.get("name") == job.name


def do_issue_runner_token(job: Job, *, actor: Any) -> str:
    """A new runner token for `job` (an operator's act); the old one stops working. Audited."""
    who, user = _who(actor)
    token, digest = new_runner_token()
    with transaction.atomic():
        Job.objects.filter(pk=job.pk).update(runner_token_hash=digest, updated_at=timezone.now())
        record("gearbox.job_runner_token_issued", actor=who, user=user, at=timezone.now(),
               summary=f"job {job.name}: a new runner token; the one before no longer works")
    return token


__all__ = ["IsJobRunner", "JobRunnerAuthentication", "RunnerPrincipal", "TOKEN_PREFIX",
           "do_issue_runner_token", "new_runner_token", "runner_actor"]
