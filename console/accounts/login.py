"""The login page, throttled (console.accounts.throttle): the console's only password check."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.http import HttpResponse

from console.accounts import throttle


class Throttled:
    """Mixed into an AuthenticationForm: refuses every attempt while the username or the address is over its failure limit, the right
    password included; counts each failure; a success clears the username's count."""

    blocked_s = 0
    cleaned_data: dict[str, Any]
    request: Any

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username") or ""
        addr = throttle.client_address(self.request)
        self.blocked_s = throttle.blocked_for_s(username, addr)
        if self.blocked_s:
            raise forms.ValidationError(
                f"Too many failed logins for this user or from this address; try again in {self.blocked_s} s.",
                code="throttled")
        try:
            cleaned = super().clean()  # type: ignore[misc]
        except forms.ValidationError:
            if self.cleaned_data.get("password"):
                throttle.failed(username, addr)
            raise
        throttle.succeeded(username, addr)
        return cleaned  # type: ignore[no-any-return]


class ThrottledAuthenticationForm(Throttled, AuthenticationForm):
    pass


class ThrottledAdminAuthenticationForm(Throttled, AdminAuthenticationForm):
    pass


class ThrottledLoginView(LoginView):
    authentication_form = ThrottledAuthenticationForm

    def form_invalid(self, form: Any) -> HttpResponse:
        resp = super().form_invalid(form)
        if getattr(form, "blocked_s", 0):
            resp.status_code = 429
            resp["Retry-After"] = str(form.blocked_s)
        return resp
