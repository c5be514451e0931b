"""The OpenAPI schema says every answer the API gives (drf-spectacular postprocessing hook).

drf-spectacular documents what each view declares; the answers every view can give are added
here once, with their bodies, so the schema matches what the server sends (schemathesis checks it
in tests/console/api/test_schema.py):

- 400 on an operation that reads parameters or a body: a field is invalid. The body names each
  field: {"field": ["reason", ...]} (a nested field: an object of the same), or {"detail": "..."}
  for a body that is not JSON;
- 401 without credentials, 403 without the role: {"detail": "..."}; 404 on a path with an id that
  names nothing: {"detail": "..."}, or the field that names what does not exist (a rollout's
  `version`): {"field": ["reason"]};
- 409: the deployment's state refuses it, the body naming the field: {"field": ["reason"]}; an
  operation whose 409 has a body of its own (a blocked emergency) may answer either;
- a request body's schema refuses unknown keys (additionalProperties: false): the serializers are
  StrictSerializer, a typo is an error, not a no-op.
"""

from __future__ import annotations

from typing import Any

DETAIL = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"],
          "description": "why the request was refused"}
FIELD_ERRORS = {
    "type": "object",
    "description": "each invalid field and why: a list of reasons, or for a nested field an object of the same; "
                   "nothing was changed",
    "additionalProperties": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object"}]},
}
GENERIC = {
    "400": "a parameter or a field of the body is invalid: the body names it; nothing changed",
    "401": "no credentials, or an unknown or revoked API token",
    "403": "the caller lacks the role this needs",
    "404": "the id in the path names nothing (or a field of the body names an object that does not exist: the body names it)",
}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _or_refusal(response: dict[str, Any]) -> None:
    """A 409 with a body of its own (a blocked emergency's offers) is still refused the usual way
    when the deployment's state refuses the request itself: either body may come."""
    for media in response.get("content", {}).values():
        schema = media.get("schema", {})
        if schema.get("$ref") and schema["$ref"] != "#/components/schemas/Refusal":
            media["schema"] = {"anyOf": [schema, {"$ref": "#/components/schemas/Refusal"}]}


def document_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Detail", DETAIL)
    schemas.setdefault("FieldErrors", FIELD_ERRORS)
    schemas.setdefault("Refusal", {"anyOf": [{"$ref": "#/components/schemas/FieldErrors"},
                                             {"$ref": "#/components/schemas/Detail"}]})
    request_bodies: set[str] = set()
    for path, operations in result.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            wanted = ["401", "403"]
            if operation.get("parameters") or operation.get("requestBody"):
                wanted.append("400")
            if "{" in path:
                wanted.append("404")
            for code in wanted:
                responses.setdefault(code, {"description": GENERIC[code]})
            for code, response in responses.items():
                if code.startswith("4") and "content" not in response:
                    response["content"] = _json("Refusal" if code in ("400", "404", "409") else "Detail")
                elif code == "409":
                    _or_refusal(response)
            for media in (operation.get("requestBody") or {}).get("content", {}).values():
                ref = media.get("schema", {}).get("$ref", "")
                if ref.startswith("#/components/schemas/"):
                    request_bodies.add(ref.rsplit("/", 1)[1])
    for name in request_bodies:
        schema = schemas.get(name)
        if isinstance(schema, dict) and schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    return result
