"""/api/v1/jobs: fine-tune and batch jobs on the pool (console/gearbox/jobs.py). Viewers read;
operators create (POST) and delete (DELETE /api/v1/jobs/<name>), as with /api/v1/deployments. A
job's runner reads its job (where it runs, whether to yield and by when) and acknowledges its
checkpoints (POST /api/v1/jobs/<name>/checkpointed: console/gearbox/admission.py) with the job's own
runner token, which the create answers once (console/gearbox/runner.py); an operator may do both
too, and issue the job a new runner token."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings

from console.accounts.auth import IsOperator, IsViewer
from console.api.serializers import StrictSerializer, refused_response
from console.fleet.actions import Rejected
from console.gearbox.admission import do_checkpointed
from console.gearbox.api_lifecycle import request_data
from console.gearbox.jobs import do_create_job, do_delete_job, job_payload
from console.gearbox.models import Job
from console.gearbox.runner import (
    IsJobRunner,
    JobRunnerAuthentication,
    RunnerPrincipal,
    do_issue_runner_token,
)

FIELDS = ("name", "gpus", "gpu_model", "priority", "grace_s", "checkpoint_s", "work_gpu_s")


class JobCreateSerializer(StrictSerializer):
    """The body of POST /api/v1/jobs (the schema's; console/gearbox/jobs.check_job checks it)."""

    name = serializers.CharField(max_length=64, help_text="its name: letters, digits, '.', '_', '-'")
    gpus = serializers.IntegerField(min_value=1, max_value=512, help_text="the GPUs it wants, all at once")
    work_gpu_s = serializers.FloatField(min_value=0, help_text="its work in GPU-seconds (> 0)")
    gpu_model = serializers.CharField(max_length=64, required=False, allow_blank=True, default="",
                                      help_text='a GPU model of the catalog; "" (the default): any')
    priority = serializers.IntegerField(min_value=-1000, max_value=1000, required=False, default=1,
                                        help_text="1 (the default); a deployment of higher priority may take its GPUs")
    grace_s = serializers.FloatField(min_value=0, max_value=300, required=False, default=30.0,
                                     help_text="how long it may take to release its GPUs once asked")
    checkpoint_s = serializers.FloatField(min_value=0, max_value=1e6, required=False, default=20.0,
                                          help_text="how long its checkpoint takes (above grace_s a yield loses "
                                                    "the work since its last checkpoint)")


class CheckpointedSerializer(StrictSerializer):
    """The body of POST /api/v1/jobs/<name>/checkpointed (console/gearbox/admission.py checks it)."""

    progress_gpu_s = serializers.FloatField(min_value=0, required=False,
                                            help_text="the work the checkpoint holds, GPU-seconds (default: all "
                                                      "it did by the console's account)")


class JobViewSet(viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = JobCreateSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9._-]{1,64}"

    # a job's runner token first: it is valid on this viewset only (console/gearbox/runner.py)
    authentication_classes = [JobRunnerAuthentication, *api_settings.DEFAULT_AUTHENTICATION_CLASSES]

    def get_permissions(self) -> list[Any]:
        if self.action == "checkpointed":
            return [(IsOperator | IsJobRunner)()]
        if self.action == "retrieve":
            return [(IsViewer | IsJobRunner)()]
        return [IsOperator()] if self.action in ("create", "destroy", "runner_token") else [IsViewer()]

    def get_queryset(self) -> QuerySet[Job]:
        return Job.objects.select_related("created_by").order_by("created_at", "name")

    @extend_schema(summary="List the fine-tune and batch jobs", operation_id="jobs_list",
                   responses={200: OpenApiTypes.OBJECT})
    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        rows = list(page if page is not None else self.get_queryset())
        return self.get_paginated_response([job_payload(j) for j in rows])

    @extend_schema(summary="One job", responses={200: OpenApiTypes.OBJECT})
    def retrieve(self, request: Request, name: str) -> Response:
        return Response(job_payload(self.get_object()))

    @extend_schema(summary="Submit a fine-tune or batch job (operator)", request=JobCreateSerializer,
                   responses={201: OpenApiTypes.OBJECT,
                              409: OpenApiResponse(description="a job of that name exists: the body names the field")},
                   description=(
                       "name, gpus, work_gpu_s (its work in GPU-seconds), and optionally gpu_model (\"\": any), "
                       "priority (1; inference deployments run at 10 and may take its GPUs), grace_s (30, at most "
                       "300) and checkpoint_s (20). Every field is checked first: a bad or unknown one is a 400 "
                       "naming it and nothing is stored; 409: the name is taken. The answer carries runner_token, "
                       "shown this once: the job's runner reads its job and acknowledges its checkpoints with it "
                       "(Authorization: Bearer fpr_...), on this job only."))
    def create(self, request: Request) -> Response:
        body = request_data(request)
        if not isinstance(body, dict):
            return refused_response(400, {"non_field_errors": "the body must be a JSON object"})
        unknown = sorted(str(k)[:100] for k in body if k not in FIELDS)
        missing = [k for k in ("name", "gpus", "work_gpu_s") if k not in body]
        if unknown or missing:
            errors = {k: f"unknown field; expected one of {', '.join(FIELDS)}" for k in unknown}
            errors.update({k: "required" for k in missing})
            return refused_response(400, errors)
        try:
            job, token = do_create_job(actor=request.user, **body)
        except Rejected as exc:
            return refused_response(exc.status, exc.errors)
        return Response({**job_payload(job), "runner_token": token}, status=status.HTTP_201_CREATED)

    @extend_schema(summary="A job's runner acknowledges a checkpoint (its runner token, or an operator)",
                   request=CheckpointedSerializer,
                   responses={200: OpenApiTypes.OBJECT,
                              409: OpenApiResponse(description="the job holds no GPUs: the body names the field")},
                   description=(
                       "Optionally progress_gpu_s: the work the checkpoint holds (from its last checkpoint to its "
                       "work; default: all it did by the console's account). A yielding job's GPUs are free at "
                       "once and it waits to resume; a running job's checkpoint is its new restart point. A bad "
                       "or unknown field is a 400 naming it and nothing changes; 409: it is not running or "
                       "yielding."))
    @action(detail=True, methods=["post"], url_path="checkpointed")
    def checkpointed(self, request: Request, name: str) -> Response:
        who = request.user.username if isinstance(request.user, RunnerPrincipal) else request.user
        try:
            job = do_checkpointed(name, request_data(request), actor=who)
        except Rejected as exc:
            return refused_response(exc.status, exc.errors)
        return Response(job_payload(job))

    @extend_schema(summary="Issue a job a new runner token (operator)", request=None,
                   responses={200: OpenApiTypes.OBJECT},
                   description="The answer carries the new runner_token, shown this once; the job's previous "
                               "runner token stops working at once. Audited.")
    @action(detail=True, methods=["post"], url_path="runner-token")
    def runner_token(self, request: Request, name: str) -> Response:
        token = do_issue_runner_token(self.get_object(), actor=request.user)
        return Response({"name": name, "runner_token": token})

    @extend_schema(summary="Delete a job (operator)", responses={204: None})
    def destroy(self, request: Request, name: str) -> Response:
        try:
            do_delete_job(self.get_object(), actor=request.user)
        except Rejected as exc:
            return refused_response(exc.status, exc.errors)
        return Response(status=status.HTTP_204_NO_CONTENT)


__all__ = ["JobViewSet"]
