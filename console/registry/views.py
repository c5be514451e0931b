"""The Registry page: versions with their hash status and who serves them; operators roll versions out,
admins also get the register form and retire buttons."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.accounts.decorators import role_required
from console.accounts.roles import ADMIN, OPERATOR, VIEWER, has_role
from console.registry.live import version_payload
from console.registry.models import ModelVersion


@role_required(VIEWER)
def registry_page(request: HttpRequest) -> HttpResponse:
    versions = [version_payload(v) for v in ModelVersion.objects.order_by("name", "-registered_at", "-id")]
    can_admin = has_role(request.user, ADMIN)
    can_operate = has_role(request.user, OPERATOR)  # roll out (an operator verb on a deployment)
    return render(request, "registry/registry.html", {
        "page_data": {"versions": versions, "can_admin": can_admin, "can_operate": can_operate},
        "can_admin": can_admin, "can_operate": can_operate,
        "engines": ModelVersion.ENGINES,
        "statuses": ModelVersion.STATUSES,
    })
