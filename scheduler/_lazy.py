"""Small helpers for immutable values computed once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class lazy(Generic[T]):  # noqa: N801 - used like `property`
    """Like functools.cached_property without the lock that Python 3.11 takes on every first
    access: the first read stores the value in the instance's __dict__, where later reads
    find it directly. Safe for frozen dataclasses (it bypasses __setattr__), and the value
    never takes part in equality or hashing."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> lazy[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | lazy[T]:
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


_CONTENT_IDS: dict[object, int] = {}
_NEXT_ID = itertools.count(1)


def content_id(value: object) -> int:
    """A small int that names `value` by content in this process: equal values get equal ids.

    Memo keys that hold it hash and compare an int instead of a nested value (whose dataclass
    fields would be hashed, and compared on every hit). The table forgets when it grows large;
    ids are never reused, so a forgotten value just gets a new one (its old memo entries miss).
    """
    hit = _CONTENT_IDS.get(value)
    if hit is None:
        if len(_CONTENT_IDS) >= 1 << 16:
            _CONTENT_IDS.clear()
        hit = _CONTENT_IDS[value] = next(_NEXT_ID)
    return hit


def make_frozen(cls: type[T], fields: dict[str, Any]) -> T:
    """An instance of the frozen dataclass `cls` with these field values, built without its
    generated __init__ (which sets each field through object.__setattr__, ~1,500 interpreter
    instructions a field): for value objects built in hot loops (estimates, blocks, plans).

    `fields` must name every field; `cls` must have no __post_init__ (checked by
    `check_plain_dataclass` where a module uses this). Equality, hashing, repr and pickling
    read the fields, so the result is indistinguishable from `cls(**fields)`.
    """
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def check_plain_dataclass(cls: type, *, field_names: tuple[str, ...]) -> None:
    """Fail at import if `make_frozen` would build `cls` wrongly: it needs exactly these fields
    and no __post_init__ validation."""
    names = tuple(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if names != field_names or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: make_frozen needs a plain dataclass with fields {field_names}")


def cached_field_hash(self: Any) -> int:
    """__hash__ for a frozen dataclass, computed from its fields once and kept on the
    instance. Assign it in the class body (`__hash__ = cached_field_hash`), with
    `__getstate__ = state_without_hash`: the dataclass then keeps it instead of generating
    one that re-hashes every field on every dict lookup - the catalog's model and GPU specs,
    the efficiency factors, the workload shape and the SLO sit in every memo key of a decision.
    """
    cached: int | None = self.__dict__.get("_hash")
    if cached is None:
        cached = hash(tuple([getattr(self, name) for name in self.__dataclass_fields__]))
        self.__dict__["_hash"] = cached
    return cached


def state_without_hash(self: Any) -> dict[str, Any]:
    """__getstate__ that leaves the cached hash behind: str hashes differ between processes."""
    state = dict(self.__dict__)
    state.pop("_hash", None)
    return state
