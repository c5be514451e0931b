from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from console.fleet import live


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/overview.html", {
        "heartbeat_timeout_s": settings.FLEXPIPE_HEARTBEAT_TIMEOUT_S,
    })


@login_required
def deployments_placeholder(request: HttpRequest) -> HttpResponse:
    """Where the Deployments item of the navigation leads until the gearbox pages replace it."""
    return render(request, "dashboard/deployments_placeholder.html")


@login_required
def cluster_json(request: HttpRequest) -> JsonResponse:
    """The same state the websocket sends on connect, for scripts and for a page's first paint."""
    return JsonResponse(live.cluster_state())


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})
