from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone

from console.accounts.decorators import role_required
from console.accounts.roles import VIEWER, has_role
from console.fleet import links, live


@role_required(VIEWER)
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/overview.html", {
        "heartbeat_timeout_s": settings.FLEXPIPE_HEARTBEAT_TIMEOUT_S,
        "links": links.link_table(timezone.now()),
    })


def cluster_json(request: HttpRequest) -> JsonResponse:
    """The same state the websocket sends on connect, for scripts and for a page's first paint. Like
    every live path (the websockets, the REST API), it needs the viewer role."""
    if not request.user.is_authenticated:
        return JsonResponse({"detail": "log in first"}, status=401)
    if not has_role(request.user, VIEWER):
        return JsonResponse({"detail": "requires the viewer role (or operator, admin)"}, status=403)
    return JsonResponse(live.cluster_state())


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})
