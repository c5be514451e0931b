"""Read-only admin pages: every gearbox write goes through an audited action (actions.py)."""

from typing import Any

from django.contrib import admin

from console.gearbox.models import Decision, Deployment, GpuReservation, Transition, TransitionStep


class ReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Deployment)
class DeploymentAdmin(ReadOnly):
    list_display = ("name", "model_name", "mode", "priority", "routing_version", "last_transition_seq")


@admin.register(Decision)
class DecisionAdmin(ReadOnly):
    list_display = ("id", "deployment", "at", "trigger", "outcome", "approval")
    list_filter = ("outcome", "trigger", "approval")


class StepInline(admin.TabularInline):  # type: ignore[type-arg]
    model = TransitionStep
    extra = 0
    fields = ("step", "attempt", "state", "started_at", "finished_at", "reason", "error")
    readonly_fields = fields

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Transition)
class TransitionAdmin(ReadOnly):
    list_display = ("deployment", "seq", "kind", "phase", "step", "attempt", "created_at", "finished_at")
    list_filter = ("phase", "kind")
    inlines = [StepInline]


@admin.register(GpuReservation)
class GpuReservationAdmin(ReadOnly):
    list_display = ("gpu_uuid", "deployment", "plan_id", "mem_bytes", "transition_seq")
