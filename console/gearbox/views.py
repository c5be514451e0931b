"""The gearbox pages: the Deployments list, one Deployment, and the review of a decision or a transition.

Each page embeds its first state (the same payload its websocket sends on connect, from
console.gearbox.present) and then follows the websocket without reloading. Operators also get the
controls; they call the REST API (CSRF, roles and audit there), never a view of their own.
"""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone

from console.accounts.decorators import role_required
from console.accounts.roles import OPERATOR, VIEWER, has_role
from console.fleet import fragments
from console.gearbox import present
from console.gearbox.models import Deployment, Transition
from console.gearbox.snapshot import fleet_snapshot, gear_gpus
from scheduler.gearbox import Outcome


@role_required(VIEWER)
def deployments_page(request: HttpRequest) -> HttpResponse:
    can_operate = has_role(request.user, OPERATOR)
    return render(request, "gearbox/deployments.html", {"can_operate": can_operate,
                                                        "versions": _deployable() if can_operate else [],
                                                        "page_data": {
        **present.deployments_state(), "switches": present.recent_switches(), "can_operate": can_operate}})


def _deployable() -> list[dict[str, object]]:
    """The registry versions a new deployment may serve (console/gearbox/lifecycle.LOADABLE), newest first."""
    from console.gearbox.lifecycle import LOADABLE
    from console.registry.models import ModelVersion

    return [{"id": v.pk, "label": f"{v.name} {v.version} ({v.engine}, {v.status})"}
            for v in ModelVersion.objects.filter(status__in=LOADABLE).order_by("name", "-registered_at", "-id")]


@role_required(VIEWER)
def deployment_page(request: HttpRequest, name: str) -> HttpResponse:
    dep = get_object_or_404(Deployment, name=name)
    can_operate = has_role(request.user, OPERATOR)
    return render(request, "gearbox/deployment.html", {
        "name": dep.name, "can_operate": can_operate, "outcomes": [o.value for o in Outcome],
        "latency_critical": dep.latency_critical, "blocks": _blocks(dep),
        "page_data": {"name": dep.name, "can_operate": can_operate, **present.deployment_state(dep)}})


def _blocks(dep: Deployment) -> list[fragments.BlockUse]:
    """The blocks the deployment's current gear uses, with their stability now."""
    now = timezone.now()
    try:
        snap = fleet_snapshot(now)
    except ValueError:
        return []
    return fragments.blocks_of(gear_gpus(dep.current_gear), snap, fragments.load_history(), now)


@role_required(VIEWER)
def decision_page(request: HttpRequest, pk: int) -> HttpResponse:
    decision = present.decision_detail(pk)
    if decision is None:
        raise Http404(f"no decision {pk}")
    transitions = [present.transition_detail(decision["deployment"], seq) for seq in decision["transitions"]]
    return _review(request, decision["deployment"], decision, [t for t in transitions if t is not None],
                   title=f"Decision {pk}")


@role_required(VIEWER)
def transition_page(request: HttpRequest, name: str, seq: int) -> HttpResponse:
    get_object_or_404(Transition, deployment__name=name, seq=seq)
    transition = present.transition_detail(name, seq)
    assert transition is not None
    decision = present.decision_detail(transition["decision"]) if transition["decision"] else None
    return _review(request, name, decision, [transition], title=f"{name} transition #{seq}")


def _review(request: HttpRequest, deployment: str, decision: dict[str, object] | None,
            transitions: list[dict[str, object]], *, title: str) -> HttpResponse:
    can_operate = has_role(request.user, OPERATOR)
    focus = "decision" if title.startswith("Decision") else "transition"
    return render(request, "gearbox/review.html", {
        "title": title, "deployment": deployment, "focus": focus, "can_operate": can_operate,
        "page_data": {"deployment": deployment, "focus": focus, "decision": decision, "transitions": transitions,
                      "can_operate": can_operate}})
