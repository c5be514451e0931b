"""The console's navigation bar: one list, rendered by templates/base.html on every page.

To add a page: give its URL pattern a name and add a `NavItem` here (or point an existing item at
it). `matches` lists the URL names under which the item is highlighted (a deployment's page and the
review of its decisions and transitions highlight "Deployments").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.urls import NoReverseMatch, reverse

from console.accounts.roles import ADMIN, has_role, role_of


@dataclass(frozen=True)
class NavItem:
    key: str  # data-nav attribute, for tests and styling
    label: str
    url_name: str
    matches: tuple[str, ...] = ()  # further URL names that light this item up
    role: str | None = None  # offered only to users holding this role (None: everyone)


NAV: tuple[NavItem, ...] = (
    NavItem("overview", "Overview", "overview"),
    NavItem("deployments", "Deployments", "deployments", matches=("deployment-detail", "decision-detail", "transition-detail")),
    NavItem("audit", "Audit", "audit-page"),
    NavItem("registry", "Registry", "registry-page"),
    NavItem("alerts", "Alerts", "alerts-page"),
    NavItem("users", "Users", "users-page", role=ADMIN),
)


def navigation(request: Any) -> dict[str, Any]:
    """Template context: `nav` (items with href and active flag) and `role` (the user's role or None)."""
    match = getattr(request, "resolver_match", None)
    current = match.url_name if match else None
    items = []
    user = getattr(request, "user", None)
    for item in NAV:
        if item.role is not None and not has_role(user, item.role):
            continue
        try:
            href = reverse(item.url_name)
        except NoReverseMatch:
            continue  # a page not wired in this build is simply not offered
        items.append({"key": item.key, "label": item.label, "href": href,
                      "active": current in (item.url_name, *item.matches)})
    return {"nav": items, "role": role_of(user) if user is not None else None}
