"""The typed answer column (``output.parse_json``): each valid structured answer as a column a
query reads without parsing it again.

- A job-wide JSON schema (``sampling.structured_outputs.json``) gives ``answer`` an Arrow type
  derived from it (:func:`answer_type`): ``string``, ``integer`` (int64), ``number`` (float64),
  ``boolean``, an ``enum`` or ``const`` of strings (string), an array with one ``items``
  schema (a list), an object with ``properties`` (a struct of those properties, in the schema's
  order; properties beyond them are not in the struct, ``generated_text`` has them), and a
  ``type`` list or an ``anyOf``/``oneOf`` of one type and ``null`` (that type). Anything else
  (an object without ``properties``, tuples, ``allOf``, unions of several types, non-string
  enums) is that field's JSON text.
- A job-wide ``choice`` gives the chosen label as a string.
- Per-row constraints (``input.sampling_columns`` ``structured_outputs`` or
  ``structured_outputs.json``, or OpenAI Batch input, where each line has its own) give JSON
  text (``large_string``): rows of one file may answer to different schemas; a chosen label is
  a JSON string there.

A local ``$ref`` gives the type of what it points at, built once however often it is met. A
type of more than :data:`MAX_TYPE_NODES` fields (a ``$ref`` reached along many paths multiplies
them) is refused, naming ``sampling.structured_outputs`` (exit 2).

``answer`` is null where ``structured_valid`` is not true (and for a per-row regex or grammar). A
valid answer that does not fit its type (an integer beyond 64 bits) is null too, with
``structured_error`` saying why. The engine's result rows carry the parsed answer under
``_answer`` (batchspec/engine/structured.py :func:`check_answer`), which no writer writes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from batchspec.errors import SpecError
from batchspec.io.input_formats import input_format

#: The column's name.
ANSWER = "answer"
#: Where a result row carries its parsed answer (not a column).
PARSED = "_answer"

#: Schemas nest at most this deep (batchspec/engine/structured.py checks 64); deeper is JSON text.
_MAX_DEPTH = 64

#: The most fields ``answer``'s Arrow type may hold: every struct field and list item in it, and
#: the column itself. An Arrow type is a tree: a definition that refers twice to the next doubles
#: it at each level, and 26 levels would be 2**26 fields (batchspec/engine/structured.py refuses
#: such a schema too, counting its objects and arrays).
MAX_TYPE_NODES = 20_000

_INT64 = (-(2**63), 2**63 - 1)


class _NoFit(ValueError):
    """A valid answer whose value does not fit its column's type."""


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _string(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _NoFit(f"expected a string, got {type(value).__name__}")


def _integer(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _NoFit(f"expected an integer, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise _NoFit(f"{value} does not fit a 64-bit integer")
    return value


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _NoFit(f"expected a number, got {type(value).__name__}")
    return float(value)


def _boolean(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise _NoFit(f"expected a boolean, got {type(value).__name__}")


Convert = Callable[[Any], Any]
#: An Arrow type, how a value becomes one, and how many fields it holds (itself included).
_Typed = tuple[pa.DataType, Convert, int]
_JSON_TEXT: _Typed = (pa.string(), _json_text, 1)
_SIMPLE: dict[str, _Typed] = {
    "string": (pa.string(), _string, 1),
    "integer": (pa.int64(), _integer, 1),
    "number": (pa.float64(), _number, 1),
    "boolean": (pa.bool_(), _boolean, 1),
}


class TypeTooLarge(ValueError):
    """A schema whose Arrow type would hold more than :data:`MAX_TYPE_NODES` fields."""


def answer_type(schema: Any) -> tuple[pa.DataType, Convert]:
    """The Arrow type a JSON schema's values take as a column, and how a (valid) value
    becomes one of that type (raising :class:`_NoFit` when it cannot). :class:`TypeTooLarge`
    past :data:`MAX_TYPE_NODES` fields, found without expanding the type: each subschema's
    type is built once at each depth and shared where it recurs."""
    arrow_type, convert, _ = _Types(schema).node(schema, 0)
    return arrow_type, convert


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _is_null(schema: Any) -> bool:
    return isinstance(schema, Mapping) and schema.get("type") == "null"


class _Types:
    """The Arrow types of one schema's subschemas, each with its count of fields (itself and
    those it holds), kept by (subschema, depth): a ``$ref`` target met again is not built
    again, so the work is linear in the schema's size, whatever the type's."""

    def __init__(self, root: Any):
        self.root = root
        self.done: dict[tuple[int, int], _Typed] = {}

    def node(self, schema: Any, depth: int) -> _Typed:
        if depth > _MAX_DEPTH or not isinstance(schema, Mapping):
            return _JSON_TEXT
        key = (id(schema), depth)
        if key not in self.done:
            typed = self._build(schema, depth)
            if typed[2] > MAX_TYPE_NODES:
                raise TypeTooLarge(
                    f"json: the answer column's type would hold more than {MAX_TYPE_NODES:,} fields "
                    "with each $ref replaced by what it points at (a $ref reached along many paths "
                    "multiplies them)"
                )
            self.done[key] = typed
        return self.done[key]

    def _build(self, schema: Mapping, depth: int) -> _Typed:
        if isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
            try:
                target = _resolve(self.root, schema["$ref"])
            except (KeyError, IndexError, ValueError, TypeError):
                return _JSON_TEXT
            return self.node(target, depth + 1)
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            texts = [v for v in values if v is not None]
            if isinstance(values, list) and texts and all(isinstance(v, str) for v in texts):
                return _SIMPLE["string"]
            return _JSON_TEXT
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key] if isinstance(schema[key], list) else []
                kinds = [o for o in options if not _is_null(o)]
                if len(kinds) == 1 and not {"type", "properties", "items"} & set(schema):
                    return self.node(kinds[0], depth + 1)
                return _JSON_TEXT
        if {"allOf", "not", "if"} & set(schema):
            return _JSON_TEXT
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            kind = kinds[0] if len(kinds) == 1 else None
            if kind is None:
                return _JSON_TEXT
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind in _SIMPLE:
            return _SIMPLE[kind]
        if kind == "array":
            items = schema.get("items")
            if not isinstance(items, Mapping) or "prefixItems" in schema:
                return _JSON_TEXT
            item_type, item, count = self.node(items, depth + 1)

            def as_list(value: Any) -> list | None:
                if value is None:
                    return None
                if not isinstance(value, list):
                    raise _NoFit(f"expected an array, got {type(value).__name__}")
                return [item(v) for v in value]

            return pa.list_(item_type), as_list, 1 + count
        if kind == "object":
            properties = schema.get("properties")
            if not isinstance(properties, Mapping) or not properties:
                return _JSON_TEXT
            fields = {str(name): self.node(sub, depth + 1) for name, sub in properties.items()}

            def as_struct(value: Any) -> dict | None:
                if value is None:
                    return None
                if not isinstance(value, dict):
                    raise _NoFit(f"expected an object, got {type(value).__name__}")
                return {name: convert(value.get(name)) for name, (_, convert, _) in fields.items()}

            count = 1 + sum(n for _, _, n in fields.values())
            return pa.struct([pa.field(name, t) for name, (t, _, _) in fields.items()]), as_struct, count
        return _JSON_TEXT


class AnswerColumn:
    """``answer``'s field and each result row's value for it."""

    def __init__(self, arrow_type: pa.DataType, convert: Convert, typed: bool):
        self.field = pa.field(ANSWER, arrow_type)
        self.convert = convert
        #: False: JSON text (per-row constraints).
        self.typed = typed

    def fill(self, result: dict) -> None:
        """Set the result row's ``answer`` from its parsed answer (null where there is none)."""
        parsed = result.get(PARSED)
        if parsed is None or result.get("structured_valid") is not True:
            result[ANSWER] = None
            return
        try:
            result[ANSWER] = self.convert(parsed)
        except (_NoFit, RecursionError, TypeError, ValueError) as exc:
            result[ANSWER] = None
            result["structured_error"] = f"answer: {exc}"[:300]

    def fields(self, kept: list[pa.Field]) -> list[pa.Field]:
        """The output's columns after ``request_id``: the kept input columns (an input column
        named ``answer`` gives way), then ``answer``."""
        return [f for f in kept if f.name != ANSWER] + [self.field]


def _constraint(value: Any) -> Mapping[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    out = dict(value) if isinstance(value, Mapping) else {}
    if isinstance(out.get("json"), str):
        out["json"] = json.loads(out["json"])
    return out


def answer_column(spec) -> AnswerColumn | None:
    """The job's (a :class:`~batchspec.spec.model.JobSpec`) answer column; None without
    ``output.parse_json``."""
    if not spec.output.parse_json:
        return None
    per_row = input_format(spec.input.format).self_describing or any(
        key == "structured_outputs" or key.startswith("structured_outputs.")
        for key in spec.input.sampling_columns
    )
    if per_row:
        return AnswerColumn(pa.large_string(), _json_text, typed=False)
    constraint = _constraint(spec.sampling.get("structured_outputs"))
    if "choice" in constraint:
        return AnswerColumn(pa.string(), _string, typed=True)
    try:
        arrow_type, convert = answer_type(constraint.get("json"))
    except TypeTooLarge as exc:
        raise SpecError("sampling.structured_outputs", str(exc)) from exc
    return AnswerColumn(arrow_type, convert, typed=True)
