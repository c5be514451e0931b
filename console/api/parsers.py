"""The REST API's JSON parser: DRF's, reading through the project's one bounded JSON reader.

agents.schema.loads refuses what json.loads would turn into a 500 further on: nesting deeper than
agents.schema.MAX_DEPTH (a RecursionError), NaN and Infinity, integers of over 4300 digits.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from agents import schema


class BoundedJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        try:
            return schema.loads(raw)
        except schema.SchemaError as exc:
            # DRF's own shape for a body that does not parse: {"detail": "JSON parse error - ..."}
            raise ParseError("JSON parse error - " + "; ".join(exc.errors.values())) from None
