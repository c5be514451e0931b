from __future__ import annotations

from typing import Any

from django.contrib import admin

from console.registry.models import ModelVersion


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Read-only: registering, verifying and retiring go through the API, which audits them."""

    list_display = ("name", "version", "engine", "status", "sha256", "registered_at")
    list_filter = ("status", "engine")
    search_fields = ("name", "version", "sha256")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False
