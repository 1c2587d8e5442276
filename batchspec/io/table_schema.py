"""A table output's column types: how a shard's kept columns are written as the table has them
(:func:`conform_kept`), the types every shard is written with (:func:`kept_target`), and whether an
existing table takes this job's output (:func:`check_output_schema`). Every table format (Delta,
Iceberg, Lance) and every reader (Parquet, JSON lines) asks these; they read Arrow types alone,
so this module imports nothing of ``io/``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchspec.errors import InputDataError, SpecError

if TYPE_CHECKING:
    import pyarrow as pa


def _castable(source: pa.DataType, target: pa.DataType, to_text: bool) -> bool:
    """Whether every value of a kept column of type ``source`` is one of ``target`` as the
    writer takes it: the same type, an integer of a wider type or a float, a float of a wider
    one, or (a JSON-lines shard's, whose values are written as their JSON text) text."""
    import pyarrow as pa

    source, target = _plain(source), _plain(target)
    if source.equals(target) or pa.types.is_null(source):
        return True
    if pa.types.is_integer(source) and pa.types.is_floating(target):
        return True
    if pa.types.is_integer(source) and pa.types.is_integer(target):
        signed_s, signed_t = pa.types.is_signed_integer(source), pa.types.is_signed_integer(target)
        return (signed_s == signed_t and target.bit_width >= source.bit_width) or (
            signed_t and not signed_s and target.bit_width > source.bit_width
        )
    if pa.types.is_floating(source) and pa.types.is_floating(target):
        return target.bit_width >= source.bit_width
    return to_text and pa.types.is_string(target)


def conform_kept(fields: list, target: list, untyped: set[str], url: str, json_lines: bool) -> list:
    """A shard's kept columns (``fields``) as the table output has them (``target``): each cast
    to the table's type where its values all are of it (:func:`_castable`; a column ``untyped``,
    one the shard's first records have no value of, takes the table's type, each later value
    checked as it is read). A JSON-lines shard without one of the columns writes it null.
    Exit 3 naming the shard and the column where a column cannot be cast or the table has no
    such column (a bad shard: ``input.on_bad_shard`` decides)."""
    have = {f.name: f for f in fields}
    out = []
    for want in target:
        own = have.pop(want.name, None)
        if own is None:
            if not json_lines:
                raise InputDataError(
                    url, f"has no column {want.name!r}, which the output table has", column=want.name
                )
            out.append(want)
        elif want.name in untyped:
            out.append(want)
        elif _plain(own.type).equals(_plain(want.type)):
            out.append(own)
        elif _castable(own.type, want.type, json_lines):
            out.append(want)
        else:
            raise InputDataError(
                url,
                f"column {want.name!r} is {own.type} here, the output table's is {want.type}, "
                "which its values cannot be cast to",
                column=want.name,
            )
    if have:
        name = next(iter(have))
        raise InputDataError(url, f"has column {name!r}, which the output table has not", column=name)
    return out


def kept_target(kept: list[tuple[list, set[str]]], table: pa.Schema | None) -> list:
    """The kept columns every shard is written with (their names from the shards, in the order
    first seen), typed as ``table`` (the output table, where it exists) has them, else as the
    first shard with a value of a column has it (an integer widened to a float where another
    shard's is a float; a column no shard has a value of: text)."""
    import pyarrow as pa

    types: dict[str, pa.DataType | None] = {}
    for fields, untyped in kept:
        for f in fields:
            seen = types.get(f.name)
            if f.name in untyped or pa.types.is_null(f.type):
                types.setdefault(f.name, None)
            elif seen is None:
                types[f.name] = f.type
            elif pa.types.is_integer(seen) and pa.types.is_floating(f.type):
                types[f.name] = pa.float64()
    have = {f.name: f.type for f in table} if table is not None else {}
    return [
        pa.field(name, _plain(have[name]) if name in have else t if t is not None else pa.string())
        for name, t in types.items()
    ]


def _plain(t):
    """An Arrow type as a table stores it: large and view variants as the plain one, list
    items and struct fields without nullability."""
    import pyarrow as pa

    if pa.types.is_large_string(t) or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_fixed_size_list(t):  # a vector column
        return pa.list_(_plain(t.value_type), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _plain(f.type)) for f in t])
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    return t


def check_output_schema(existing: pa.Schema, ours: pa.Schema, key: str, shown: str) -> None:
    """Exit 2 naming the first column where the table's schema and this job's output differ."""
    have = {f.name: f for f in existing}
    for f in ours:
        if f.name not in have:
            raise SpecError(
                key,
                f"the table {shown} has no column {f.name!r} this job writes (its columns: "
                f"{', '.join(existing.names)}); write to a new table",
            )
        if not _plain(have[f.name].type).equals(_plain(f.type)):
            raise SpecError(
                key,
                f"column {f.name!r} of the table {shown} is {have[f.name].type}, this job writes "
                f"{f.type}; write to a new table",
            )
    extra = [n for n in existing.names if n not in set(ours.names)]
    if extra:
        raise SpecError(
            key,
            f"the table {shown} has column {extra[0]!r}, which this job does not write "
            "(another job's table?); write to a new table",
        )
