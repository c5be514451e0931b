"""Machine paths answer errors in JSON, whatever went wrong and whatever DEBUG says.

/api/ (the REST API), /agent/ (agent protocol v1), /metrics and /v1/ (the OpenAI gateway) are read by
programs: an HTML page - Django's debug page, or its plain "Bad Request (400)" - is noise to them.
`JsonErrors` (the outermost middleware) does three things on those paths:

* a body larger than settings.DATA_UPLOAD_MAX_MEMORY_SIZE is refused with 413 before it is read
  when its Content-Length says so, and when a body without one turns out too big once read;
* an exception a view did not handle becomes a JSON 500 (logged with its traceback);
* any other HTML error response (the URL resolver's 404, a CSRF failure page, a 400 for a bad
  Host) is rewritten as JSON with the same status.

Shapes: DRF's `{"detail": "..."}` everywhere but /v1/, which uses OpenAI's
`{"error": {"message", "type", "param", "code"}}` as the gateway's own errors do (docs/gateway.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)
MACHINE_PREFIXES = ("/api/", "/agent/", "/v1/", "/metrics")
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


def is_machine_path(path: str) -> bool:
    return path.startswith(MACHINE_PREFIXES) and not path.startswith("/api/docs/")


def error_response(path: str, status: int, message: str, *, code: str | None = None) -> JsonResponse:
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"),
                                          "param": None, "code": code}}
    else:
        body = {"detail": message} | ({"code": code} if code else {})
    return JsonResponse(body, status=status)


def too_big(path: str, length: int | None) -> JsonResponse:
    limit = int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    got = f"{length} bytes" if length is not None else "more"
    return error_response(path, 413, f"body: {got} is over the limit of {limit} bytes", code="body_too_large")


def _declared_length(request: HttpRequest) -> int | None:
    raw = request.META.get("CONTENT_LENGTH") or ""
    return int(raw) if raw.isdigit() else None


class JsonErrors:
    """The middleware (module docstring). Works for sync and async views alike."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        early = self._before(request)
        return early if early is not None else self._after(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        early = self._before(request)
        if early is not None:
            return early
        get: Callable[[HttpRequest], Awaitable[HttpResponse]] = self.get_response
        return self._after(request, await get(request))

    def _before(self, request: HttpRequest) -> HttpResponse | None:
        if not is_machine_path(request.path):
            return None
        length = _declared_length(request)
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and length is not None and length > int(limit):
            return too_big(request.path, length)
        return None

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not is_machine_path(request.path):
            return None
        if isinstance(exc, RequestDataTooBig):
            return too_big(request.path, _declared_length(request))
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(request.path, 500, f"internal error ({exc.__class__.__name__}); it is logged",
                              code="internal_error")

    def _after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if (not is_machine_path(request.path) or response.status_code < 400
                or not response.get("Content-Type", "").startswith("text/html")):
            return response
        try:
            phrase = HTTPStatus(response.status_code).phrase
        except ValueError:
            phrase = "error"
        return error_response(request.path, response.status_code, f"{phrase}: {request.path}")
