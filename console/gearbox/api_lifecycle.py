"""The deployments API's writes of a whole deployment: create (POST) and change (PATCH); delete stays
in console/gearbox/api.py beside the reads. Operators create and change, each one action of
console/gearbox/lifecycle.py (one transaction, audited, the caller as actor); a bad field is a 400
naming it, and nothing is stored."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from console.api.serializers import refused_response
from console.fleet.actions import Rejected
from console.gearbox import lifecycle, present
from console.gearbox.models import Deployment
from console.gearbox.serializers import (
    NAME,
    REFUSALS,
    DeploymentChangeSerializer,
    DeploymentCreateSerializer,
    DeploymentSerializer,
)


def request_data(request: Request) -> Any:
    """The JSON body; an empty body is an empty object (every field of these verbs has a default or is
    reported missing by name)."""
    return request.data if request.body else {}


def deployment_body(dep: Deployment) -> dict[str, Any]:
    return present.deployment_payload(dep, present.DeploymentContext.load([dep]))


class DeploymentWrites:
    """Mixed into DeploymentViewSet: POST on the collection, PATCH on one deployment."""

    get_object: Any

    @extend_schema(summary="Create a deployment of a registry version (operator)", request=DeploymentCreateSerializer,
                   responses={201: DeploymentSerializer, **{k: v for k, v in REFUSALS.items() if k != 404}},
                   description=(
                       "The model version comes from the registry (verified, or awaiting its first agent's "
                       "hash); a model whose architecture is not in the built-in catalog is planned from its "
                       "registered config.json. baseline_gear \"auto\" lets the planner choose the best gear "
                       "that fits the fleet now; a spec is checked against invariant 4 like an override. Every "
                       "field is checked first: a bad one is a 400 naming it and nothing is stored; 409: the "
                       "name is taken. The gearbox brings the baseline up on its next tick (asked for at once)."))
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        body = DeploymentCreateSerializer(data=request_data(request))
        body.is_valid(raise_exception=True)
        try:
            dep = lifecycle.do_create_deployment(**body.validated_data, actor=request.user)
        except Rejected as exc:
            return refused_response(exc.status, exc.errors)
        return Response(deployment_body(Deployment.objects.get(pk=dep.pk)), status=status.HTTP_201_CREATED)

    @extend_schema(summary="Change a deployment's SLO, priority, replica bounds or idle time (operator)",
                   request=DeploymentChangeSerializer, responses={200: DeploymentSerializer, **REFUSALS},
                   parameters=[NAME], description=(
                       "Only the fields given change, checked together with the others (min_replicas <= "
                       "max_replicas; idle_to_zero_s needs min_replicas 0). Audited with before and after; "
                       "nothing switches because of it. 409 while the deployment is being deleted."))
    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        dep = self.get_object()
        body = DeploymentChangeSerializer(data=request_data(request))
        body.is_valid(raise_exception=True)
        try:
            dep = lifecycle.do_change_deployment(dep.name, dict(body.validated_data), actor=request.user)
        except Rejected as exc:
            return refused_response(exc.status, exc.errors)
        return Response(deployment_body(dep))


__all__ = ["DeploymentWrites", "deployment_body", "request_data"]
