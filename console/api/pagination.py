"""Limit/offset pagination that refuses bad numbers instead of silently ignoring them.

DRF's LimitOffsetPagination falls back to the default for `limit=abc` or `offset=-3`; a client
that made a mistake should hear about it (400 naming the parameter), so these raise.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 10**9


def _int_param(request: Any, name: str, *, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw == "":
        raise ValidationError({name: [f"must not be empty: an integer between {low} and {high}"]})
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: [f"must be an integer between {low} and {high}; got {raw[:40]!r}"]}) from None
    if not low <= value <= high:
        raise ValidationError({name: [f"must be between {low} and {high}; got {value}"]})
    return value


class StrictLimitOffsetPagination(LimitOffsetPagination):
    default_limit = 100
    max_limit = 1000

    def get_limit(self, request: Any) -> int:
        return _int_param(request, self.limit_query_param, default=self.default_limit, low=1, high=self.max_limit)

    def get_offset(self, request: Any) -> int:
        return _int_param(request, self.offset_query_param, default=0, low=0, high=MAX_OFFSET)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        params = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, MAX_OFFSET)}
        for p in params:
            low, high = bounds[p["name"]]
            p["schema"] = {"type": "integer", "minimum": low, "maximum": high}
        return params
