"""Django's own error answers for the JSON parts of the site (/api/, /agent/, /v1/): a path that no
URL pattern matches answers JSON there too, as the schema says (console/api/openapi.py), not an
HTML page. Pages keep Django's HTML."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import page_not_found

JSON_PREFIXES = ("/api/", "/agent/", "/v1/")


def not_found(request: HttpRequest, exception: Exception | None = None, **kwargs: Any) -> HttpResponse:
    if request.path.startswith(JSON_PREFIXES):
        if request.path.startswith("/v1/"):  # the OpenAI-compatible gateway's error shape
            return JsonResponse({"error": {"message": f"no such endpoint: {request.path}", "type": "invalid_request_error",
                                           "param": None, "code": "not_found"}}, status=404)
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)  # type: ignore[arg-type]
