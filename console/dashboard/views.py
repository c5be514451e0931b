from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone

from console.accounts.roles import VIEWER, has_role
from console.fleet import links, live


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/overview.html", {
        "heartbeat_timeout_s": settings.FLEXPIPE_HEARTBEAT_TIMEOUT_S,
        # the deployments, switches and atomic blocks come from /ws/gearbox/, which needs the viewer role
        "gearbox": has_role(request.user, VIEWER),
        "links": links.link_table(timezone.now()),
    })


@login_required
def cluster_json(request: HttpRequest) -> JsonResponse:
    """The same state the websocket sends on connect, for scripts and for a page's first paint."""
    return JsonResponse(live.cluster_state())


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})
