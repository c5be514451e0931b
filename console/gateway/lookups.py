"""The gateway's database lookups: sync functions that console.gateway.views runs in a thread
(sync_to_async) - the API token's user, a deployment's routing table and SLO, a node's data
address, the tokenizer a deployment serves with, the model list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Q


def _user_for(token: str) -> Any | None:
    from django.utils import timezone

    from console.accounts.auth import hash_token
    from console.accounts.models import ApiToken
    from console.accounts.roles import VIEWER, has_role

    row = ApiToken.objects.select_related("user").filter(token_hash=hash_token(token), revoked_at=None).first()
    if row is None or not has_role(row.user, VIEWER):
        return None
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
    return row.user


@dataclass(frozen=True)
class _Deployment:
    name: str
    model_name: str
    version: int
    routes: list[dict[str, Any]]
    # the registry version's max_context (tokens: prompt + output), when it serves one: it binds below
    # the tokenizer's own limit (registry field enforced at the gateway, issue 17)
    max_context: int | None = None
    version_label: str = ""
    slo_s: tuple[float, float] | None = None  # (TTFT, TPOT) objectives: what learned routing holds it to
    at_zero: bool = False  # scaled to zero: its gear was released (its next request is held)


def _deployment(model: str) -> _Deployment | None:
    from console.gearbox.models import Deployment

    row = (Deployment.objects.filter(Q(name=model) | Q(model_name=model)).order_by("-priority", "name")
           .values("name", "model_name", "routing_version", "routing", "model_version__max_context",
                   "model_version__version", "ttft_ms", "tpot_ms", "zero_since").first())
    if row is None:
        return None
    routes = row["routing"] if isinstance(row["routing"], list) else []
    return _Deployment(row["name"], row["model_name"], row["routing_version"], routes,
                       row["model_version__max_context"], row["model_version__version"] or "",
                       (row["ttft_ms"] / 1e3, row["tpot_ms"] / 1e3), row["zero_since"] is not None)


def _wake(name: str) -> bool:
    from console.gearbox.zero import do_request_wake

    return do_request_wake(name)


def _data_addr(node_id: str) -> str:
    from console.fleet.models import Node

    return Node.objects.filter(node_id=node_id).values_list("data_addr", flat=True).first() or ""


def _tokenizer_path(dep: _Deployment) -> str | None:
    from console.registry.models import ModelVersion

    # the version the deployment serves (only a rollout changes it: registering one changes nothing)
    served = (ModelVersion.objects.filter(deployments__name=dep.name).values_list("tokenizer", flat=True).first())
    if served:
        return str(served)
    configured = getattr(settings, "FLEXPIPE_GATEWAY_TOKENIZERS", {}) or {}
    for key in (dep.name, dep.model_name, "*"):
        if key in configured:
            return str(configured[key])
    return None


def _models() -> list[dict[str, Any]]:
    from console.gearbox.models import Deployment

    return [{"id": d["name"], "object": "model", "created": int(d["created_at"].timestamp()),
             "owned_by": "flexpipe", "root": d["model_name"]}
            for d in Deployment.objects.order_by("name").values("name", "model_name", "created_at")]
