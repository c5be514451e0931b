"""Serializer helpers shared by the apps' APIs."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.response import Response


class StrictSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """A request body serializer that refuses keys it does not know (a typo is an error, not a no-op)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            writable = {name for name, f in self.fields.items() if not f.read_only}
            unknown = sorted(str(k) for k in data if k not in writable)
            if unknown:
                raise serializers.ValidationError(
                    {k[:100]: [f"unknown field; expected one of {', '.join(sorted(writable))}"] for k in unknown})
            # DRF's CharField turns 0 into "0": a number where the schema says string is an error here
            not_text = {name: ["must be a string"] for name, value in data.items()
                        if isinstance(self.fields.get(name), serializers.CharField)
                        and value is not None and not isinstance(value, str)}
            if not_text:
                raise serializers.ValidationError(not_text)
            # ... and DRF's BooleanField takes "yes", "1" and 1 for true: only a JSON boolean is one here
            not_bool = {name: ["must be true or false"] for name, value in data.items()
                        if isinstance(self.fields.get(name), serializers.BooleanField) and not isinstance(value, bool)}
            if not_bool:
                raise serializers.ValidationError(not_bool)
        return super().to_internal_value(data)


def refused_response(status: int, errors: dict[str, str]) -> Response:
    """An action's refusal in DRF's error shape: {field: [reason]}."""
    return Response({field: [reason] for field, reason in errors.items()}, status=status)
