"""GET /agent/v1/routing: the deployments' routing tables, for gateways and the simulated fleet.

Agent protocol v1 (agents/protocol/), agent token required. The answer:

    {"deployments": [{"name": "chat-8b", "model": "Llama-3-8B", "version": 7,
                      "routes": [{"plan_id": "p-...", "weight": 0.9, "frozen": false,
                                  "nodes": ["h100-a"], "plan": {...}}]}]}

A request goes to one unfrozen route, picked by weight; the first node is the plan's leader.
Requests it admits carry the lease (plan_id, version).
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from console.fleet.actions import node_for_token
from console.gearbox.models import Deployment


@require_GET
def routing(request: HttpRequest) -> JsonResponse:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or node_for_token(token.strip()) is None:
        return JsonResponse({"errors": {"Authorization": "send 'Authorization: Bearer <agent token>'"}}, status=401)
    out = [{"name": d["name"], "model": d["model_name"], "version": d["routing_version"], "routes": d["routing"]}
           for d in Deployment.objects.order_by("name").values("name", "model_name", "routing_version", "routing")]
    return JsonResponse({"deployments": out})
