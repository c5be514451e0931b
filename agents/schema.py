"""Strict readers for plain-JSON documents (wire messages, scenario files).

A reader walks a decoded document and collects every problem with the path of the key that
caused it (`gpus[2].mem_used_bytes: must be an integer >= 0`), instead of stopping at the first.
Unknown keys are problems too: a typo must never be silently ignored. Callers read all fields,
call `done()` on each object reader, and raise `SchemaError` if anything was collected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

# Every integer a document carries fits a signed 64-bit column (PostgreSQL bigint, jsonb read back
# by other tools): a bigger one is refused by the reader, whatever the field, before anything stores it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# How deep a wire document may nest. Ours nest 4 levels (a report's gpus[i].custom_spec.links...);
# a 100,000-deep body would otherwise exhaust the parser's recursion (a 500) or a walker after it.
MAX_DEPTH = 32


class SchemaError(ValueError):
    """A document failed validation. `errors` maps a key path to the reason."""

    def __init__(self, errors: dict[str, str], what: str = "document") -> None:
        self.errors = dict(errors)
        lines = "; ".join(f"{path}: {reason}" for path, reason in self.errors.items())
        super().__init__(f"invalid {what}: {lines}")


_MISSING = object()


class Problems:
    """The shared list of problems of one document."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    def add(self, path: str, reason: str) -> None:
        # Keep the first reason per path: it is the root cause, later ones follow from it.
        self.errors.setdefault(path or "(document)", reason)

    def raise_if_any(self, what: str = "document") -> None:
        if self.errors:
            raise SchemaError(self.errors, what)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


class ObjectReader:
    """Reads the keys of one JSON object; remembers which keys were consumed."""

    def __init__(self, value: Any, path: str, problems: Problems) -> None:
        self.path = path
        self.problems = problems
        self.ok = isinstance(value, dict)
        self._data: dict[str, Any] = value if isinstance(value, dict) else {}
        self._seen: set[str] = set()
        if not self.ok:
            problems.add(path, f"must be an object, not {_type_name(value)}")

    # -- access -----------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._data

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        value, _ = self._get(key, default)
        return value

    def _get(self, key: str, default: Any) -> tuple[Any, bool]:
        """(value, final): final means the caller returns the value as it is, unchecked.

        A missing key takes the default (or is an error when there is none); an explicit null is
        accepted only where the default is None, i.e. where the field is optional.
        """
        self._seen.add(key)
        if key not in self._data:
            if default is _MISSING:
                if self.ok:
                    self.problems.add(_join(self.path, key), "is required")
                return None, True
            return default, True
        value = self._data[key]
        if value is None:
            if default is not None:
                self.problems.add(_join(self.path, key), "must not be null")
            return None, True
        return value, False

    def child_path(self, key: str) -> str:
        return _join(self.path, key)

    def fail(self, key: str, reason: str) -> None:
        self.problems.add(_join(self.path, key), reason)

    # -- typed getters: return None (and record a problem) when the value is wrong ------------
    def str(self, key: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None,
            max_len: int = 200, allow_empty: bool = False) -> Any:
        value, final = self._get(key, default)
        if final:
            return value
        if not isinstance(value, str):
            self.fail(key, f"must be a string, not {_type_name(value)}")
            return None
        if not value and not allow_empty:
            self.fail(key, "must not be empty")
            return None
        if len(value) > max_len:
            self.fail(key, f"must be at most {max_len} characters")
            return None
        if choices is not None and value not in choices:
            self.fail(key, f"must be one of {', '.join(choices)}; got {value!r}")
            return None
        return value

    def int(self, key: str, default: Any = _MISSING, *, min: int | None = None,
            max: int | None = None) -> Any:
        value, final = self._get(key, default)
        if final:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"must be an integer, not {_type_name(value)}")
            return None
        if not INT64_MIN <= value <= INT64_MAX:
            self.fail(key, "must fit in a signed 64-bit integer (at most 2^63 - 1 in size)")
            return None
        return self._bounded(key, value, min, max)

    def num(self, key: str, default: Any = _MISSING, *, min: float | None = None,
            max: float | None = None, exclusive_min: bool = False) -> Any:
        value, final = self._get(key, default)
        if final:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            self.fail(key, f"must be a finite number, not {_type_name(value)}")
            return None
        if exclusive_min and min is not None and value <= min:
            self.fail(key, f"must be greater than {min}")
            return None
        return self._bounded(key, float(value), min, max)

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        value, final = self._get(key, default)
        if final:
            return value
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, not {_type_name(value)}")
            return None
        return value

    def obj(self, key: str, default: Any = _MISSING) -> ObjectReader | None:
        value, final = self._get(key, default)
        if final:
            return None
        return ObjectReader(value, _join(self.path, key), self.problems)

    def list(self, key: str, default: Any = _MISSING, *, min_len: int = 0,
             max_len: int = 100_000) -> ListReader | None:
        value, final = self._get(key, default)
        if final:
            return None if value is None else ListReader(list(value), _join(self.path, key), self.problems)
        if not isinstance(value, list):
            self.fail(key, f"must be a list, not {_type_name(value)}")
            return None
        if len(value) < min_len:
            self.fail(key, f"must have at least {min_len} item{'s' if min_len != 1 else ''}")
            return None
        if len(value) > max_len:
            self.fail(key, f"must have at most {max_len} items")
            return None
        return ListReader(value, _join(self.path, key), self.problems)

    def done(self) -> None:
        """Record every key nobody asked for: unknown keys are errors, not ignored."""
        for key in self._data:
            if key not in self._seen:
                self.problems.add(_join(self.path, key), "unknown key")

    def _bounded(self, key: str, value: Any, lo: Any, hi: Any) -> Any:
        if lo is not None and value < lo:
            self.fail(key, f"must be >= {lo}; got {value}")
            return None
        if hi is not None and value > hi:
            self.fail(key, f"must be <= {hi}; got {value}")
            return None
        return value


class ListReader:
    def __init__(self, value: list[Any], path: str, problems: Problems) -> None:
        self.path = path
        self.problems = problems
        self._items = value

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(self._items):
            yield f"{self.path}[{i}]", item

    def objects(self) -> Iterator[ObjectReader]:
        for path, item in self.items():
            yield ObjectReader(item, path, self.problems)


def _finite(value: int | float) -> bool:
    # A 400-digit integer is an int, and math.isfinite() raises OverflowError converting it.
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH, where: str = "(body)") -> Any:
    """Decode one JSON document, or raise SchemaError naming `where`: not JSON, NaN/Infinity
    (Python's json accepts them), an integer of over 4300 digits, or nesting deeper than max_depth.

    The one JSON reader of request bodies (agent API, gateway, REST): none of them may answer 500.
    """
    try:
        value = json.loads(raw or b"null", parse_constant=_refuse_constant)
    except RecursionError:
        raise SchemaError({where: f"must not nest deeper than {max_depth} levels"}, "body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError({where: f"not valid JSON: {exc}"}, "body") from None
    if depth_exceeds(value, max_depth):
        raise SchemaError({where: f"must not nest deeper than {max_depth} levels"}, "body")
    return value


def depth_exceeds(value: Any, max_depth: int) -> bool:
    """True when lists/objects nest deeper than max_depth (a scalar is depth 0). Iterative: no recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth + 1 > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def read_document(value: Any) -> tuple[ObjectReader, Problems]:
    problems = Problems()
    return ObjectReader(value, "", problems), problems


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
