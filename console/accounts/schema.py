"""How the OpenAPI schema describes our API tokens (drf-spectacular extension, loaded in apps.ready)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[misc]
    target_class = "console.accounts.auth.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "fpu_…",
                "description": "A user's API token (manage.py create_api_token USER). Agent tokens are refused here."}


class JobRunnerScheme(OpenApiAuthenticationExtension):  # type: ignore[misc]
    target_class = "console.gearbox.runner.JobRunnerAuthentication"
    name = "jobRunnerToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "fpr_…",
                "description": "A job's runner token (POST /api/v1/jobs answers it once): valid on GET "
                               "/api/v1/jobs/{name} and POST /api/v1/jobs/{name}/checkpointed of its own job only."}
