"""The spec's reading primitives: a section of the YAML and the dataclass that types it
(:class:`Fields`), each value checked with an error naming its dotted key (exit 2), each
default and each ``Literal`` choice read from the dataclass (spec/model.py)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from types import UnionType
from typing import Any

from batchspec.errors import SpecError


class Fields:
    """One section of the spec and the dataclass that types it: each value checked with errors
    naming ``<section>.<key>``, each default the one the dataclass declares."""

    def __init__(self, raw: dict, name: str, cls: type, required: bool, keys=None):
        self.values = section(raw, name, required=required)
        self.name, self.cls = name, cls
        check_keys(self.values, keys or [f.name for f in dataclasses.fields(cls)], name)

    def get(self, key: str, types, required: bool = False) -> Any:
        """The key's value (its default when absent), of ``types`` and, where the field's type
        is a ``Literal``, one of its values."""
        value = get_value(self.values, key, types, self.name, required=required, default=self.default(key))
        choices = choices_of(self.cls).get(key)
        if choices is not None and value is not None and value not in choices:
            shown = " or ".join(filter(None, (", ".join(map(repr, choices[:-1])), repr(choices[-1]))))
            optional = " (or no key)" if self.default(key) is None else ""
            raise SpecError(join_key(self.name, key), f"expected {shown}{optional}, got {value!r}")
        return value

    def positive(self, key: str) -> int:
        return positive_value(self.values, key, self.name, self.default(key))

    def seconds(self, key: str, allow_zero: bool) -> float:
        return seconds_value(self.values, key, self.name, self.default(key), allow_zero=allow_zero)

    def default(self, key: str) -> Any:
        """The field's default as its dataclass declares it (a fresh copy for mutable ones);
        None for a field without one."""
        f = self.cls.__dataclass_fields__.get(key)
        if f is None:
            return None
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return None if f.default is dataclasses.MISSING else f.default


@functools.cache
def choices_of(cls: type) -> dict[str, tuple]:
    """Each field of a spec dataclass typed with a ``Literal`` (or an optional one): its values."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) in (typing.Union, UnionType):
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        if typing.get_origin(tp) is typing.Literal:
            out[name] = typing.get_args(tp)
    return out


def section(raw: dict, key: str, required: bool) -> dict:
    value = raw.get(key)
    if value is None:
        if required:
            raise SpecError(key, "missing required section")
        return {}
    if not isinstance(value, dict):
        raise SpecError(key, f"expected a mapping, got {kind_of(value)}")
    return value


def check_keys(section: dict, allowed, where: str) -> None:
    allowed = tuple(allowed)
    for key in section:
        if key not in allowed:
            raise SpecError(
                join_key(where, key),
                f"unknown key{suggest(str(key), allowed)}; allowed here: {', '.join(allowed)}",
            )


def get_value(section: dict, key: str, types, where: str, required: bool = False, default=None):
    value = section.get(key)
    if value is None:
        if required:
            raise SpecError(join_key(where, key), "missing required key")
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SpecError(join_key(where, key), f"expected {type_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise SpecError(join_key(where, key), f"expected {type_names(types)}, got {kind_of(value)}")
    return value


def positive_value(section: dict, key: str, where: str, default: int) -> int:
    value = get_value(section, key, int, where, default=default)
    if value <= 0:
        raise SpecError(join_key(where, key), f"expected a positive integer, got {value}")
    return value


def seconds_value(section: dict, key: str, where: str, default: float, allow_zero: bool) -> float:
    value = float(get_value(section, key, (int, float), where, default=default))
    if not value < float("inf") or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise SpecError(join_key(where, key), f"expected a number of seconds, {bound}, got {value:g}")
    return value


def check_known_keys(values: dict, known, where: str) -> None:
    """Raise a SpecError naming the first key of ``values`` not in ``known``, with a suggestion."""
    known = tuple(known)
    for key in values:
        if key not in known:
            raise SpecError(join_key(where, key), f"unknown key{suggest(str(key), known)}")


def suggest(key: str, choices) -> str:
    close = difflib.get_close_matches(key, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def join_key(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def kind_of(value) -> str:
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(kind_of(t()) if t is not type(None) else "null" for t in types)
