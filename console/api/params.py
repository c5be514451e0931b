"""Reading query parameters for list filters: every bad value is collected and reported by name.

    q = QueryParams(request.query_params)
    actor = q.text("actor")
    since = q.datetime("since")
    q.raise_if_any()          # 400 {"since": ["..."], ...}; nothing was queried

Strings are refused when they hold a NUL character (PostgreSQL text cannot store one, so the
query would fail with a 500) or exceed their length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import ValidationError

MAX_BIGINT = 2**63 - 1


class QueryParams:
    """`blank_is_absent`: a page's filter form sends every field, the empty ones as ``name=``; the API
    refuses an empty choice, integer or date-time (the schema says what each must be), and reads an
    empty text filter as no filter."""

    def __init__(self, params: Mapping[str, str], *, blank_is_absent: bool = False) -> None:
        self._params = params  # request.query_params (DRF) or request.GET (a page)
        self.blank_is_absent = blank_is_absent
        self.errors: dict[str, list[str]] = {}

    def _typed(self, name: str, max_len: int) -> str | None:
        """The raw value of a choice, integer or date-time parameter: empty is an error for the API."""
        if self._params.get(name) == "" and not self.blank_is_absent:
            self.fail(name, "must not be empty")
            return None
        return self.text(name, max_len=max_len)

    def fail(self, name: str, reason: str) -> None:
        self.errors.setdefault(name, []).append(reason)

    def text(self, name: str, *, max_len: int = 200) -> str | None:
        raw = self._params.get(name)
        if raw is None or raw == "":
            return None
        if "\x00" in raw:
            self.fail(name, "must not contain a NUL character")
            return None
        if len(raw) > max_len:
            self.fail(name, f"must be at most {max_len} characters; got {len(raw)}")
            return None
        return str(raw)

    def choice(self, name: str, choices: Sequence[str]) -> str | None:
        raw = self._typed(name, 200)
        if raw is not None and raw not in choices:
            self.fail(name, f"must be one of {', '.join(choices)}; got {raw[:40]!r}")
            return None
        return raw

    def integer(self, name: str, *, low: int = 0, high: int = MAX_BIGINT) -> int | None:
        raw = self._typed(name, 30)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            self.fail(name, f"must be an integer; got {raw!r}")
            return None
        if not low <= value <= high:
            self.fail(name, f"must be between {low} and {high}; got {value}")
            return None
        return value

    def datetime(self, name: str) -> datetime | None:
        raw = self._typed(name, 64)
        if raw is None:
            return None
        try:
            value = parse_datetime(raw.replace(" ", "+"))  # a literal '+' in a query string arrives as ' '
        except ValueError:
            value = None
        if value is None:
            self.fail(name, f"must be an ISO 8601 date-time such as 2026-11-29T12:00:00Z; got {raw!r}")
            return None
        if timezone.is_naive(value):
            value = timezone.make_aware(value, UTC)
        try:
            # in UTC: PostgreSQL refuses offsets beyond 15:59 (ISO 8601 allows up to 23:59) with a server error
            return value.astimezone(UTC)
        except OverflowError:
            self.fail(name, f"is out of range once in UTC; got {raw!r}")
            return None

    def raise_if_any(self) -> None:
        if self.errors:
            raise ValidationError(self.errors)
