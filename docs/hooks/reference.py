"""MkDocs hook: the reference pages that are generated from the code, so that they cannot drift.

- ``docs/reference/spec.md``: every job-spec key, with its type, default and meaning, from the
  dataclasses of ``batchspec/spec/model.py`` and their ``#:`` field comments (the one place a key
  is described);
- ``docs/reference/columns.md``: every output column, with its type and meaning, from
  ``batchspec/columns.py`` and its ``#:`` comments.

Each page holds a marker (``<!-- generated: spec-keys -->``, ``<!-- generated: columns -->``) that
the generated Markdown replaces. A key or a column without a description fails the build, and so
does a marker with nothing to replace it. ``python docs/hooks/reference.py spec|columns`` prints
what a page gets."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

SPEC_MARKER = "<!-- generated: spec-keys -->"
COLUMNS_MARKER = "<!-- generated: columns -->"

#: Fields whose YAML key is not the field's name (spec/build.py reads ``input.path``).
YAML_NAMES = {"InputSpec.paths": "path", "JobSpec.speculative_auto": "speculative"}
#: Fields that are no key of the YAML: the resolved mapping a spec was built from, and what the
#: spec finds from the model (an embedding's size, whether it scores with a cross-encoder).
NOT_KEYS = {"JobSpec.raw", "JobSpec.dimensions", "JobSpec.cross_encoder"}
#: Types as the YAML may give them, where spec/build.py takes more than the field's type.
YAML_TYPES = {
    "InputSpec.paths": "string or list of strings",
    "JobSpec.speculative": "mapping, `auto` or null",
}
#: Keys whose meaning ends with a list from spec/model.py: (constant, what it lists).
LISTS = {"InputSpec.sampling_columns": ("ROW_OVERRIDABLE", "Fields a row may override")}


class MissingDescription(Exception):
    """A key or a column that the code does not describe."""


# ------------------------------------------------------------------------------ comments


def field_comments(path: Path) -> dict[str, str]:
    """``#:`` comments in a module: ``Class.field`` (annotated fields of each class) and ``NAME``
    (module-level assignments) -> the comment lines just above it, joined."""
    source = path.read_text()
    lines = source.splitlines()
    comments: dict[str, str] = {}
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    text = comment_above(lines, stmt.lineno)
                    if text:
                        comments[f"{node.name}.{stmt.target.id}"] = text
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            text = comment_above(lines, node.lineno)
            for target in targets:
                if isinstance(target, ast.Name) and text:
                    comments[target.id] = text
    return comments


def column_comments(path: Path, namespace: dict, list_name: str | None = None) -> dict[str, str]:
    """``#:`` comments above each ``pa.field(NAME, ...)`` of a module: column name -> text. NAME is
    a string or a constant of ``namespace`` (the module's). With ``list_name``, only the fields
    written in that module-level list (a column named in several lists, such as
    ``num_prompt_tokens``, is described in each)."""
    source = path.read_text()
    lines = source.splitlines()
    comments: dict[str, str] = {}
    tree = ast.parse(source)
    if list_name is not None:
        tree = next(
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and any(
                isinstance(t, ast.Name) and t.id == list_name
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
        )
    for node in ast.walk(tree):
        if list_name is not None and isinstance(node, ast.Starred) and isinstance(node.value, ast.Name):
            comments.update(column_comments(path, namespace, node.value.id))  # *FEATURE_FIELDS
            continue
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "field"
            and node.args
        ):
            continue
        first = node.args[0]
        name = (
            first.value
            if isinstance(first, ast.Constant)
            else namespace.get(first.id)
            if isinstance(first, ast.Name)
            else None
        )
        text = comment_above(lines, node.lineno)
        if isinstance(name, str) and text:
            comments[name] = text
    return comments


def comment_above(lines: list[str], lineno: int) -> str:
    """The ``#:`` lines right above line ``lineno`` (1-based), as one paragraph."""
    found = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        found.append(lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(reversed(found)).strip()


def markdown(text: str) -> str:
    """A docstring's or comment's reST-style literals (````x````) as Markdown code."""
    text = re.sub(r":(?:func|class|meth|data|mod):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def yaml_words(text: str) -> str:
    """A comment written from Python's side as a YAML writer reads it: None is null."""
    return re.sub(r"\bNone\b", "null", text)


# ------------------------------------------------------------------------------ spec keys


PLURALS = {str: "strings", int: "integers", float: "numbers"}


def type_name(tp) -> str:
    """A field's type as a YAML writer sees it."""
    if tp is type(None):
        return "null"
    if tp is typing.Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (tuple, list):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {PLURALS.get(inner[0], type_name(inner[0]))}" if inner else "list"
    if origin is dict:
        if not args or args[1] is typing.Any:
            return "mapping"
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        dict: "mapping",
        list: "list",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_value(value) -> str:
    """A default as it would be written in the YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value} ({value // 2**20} MiB)"
    return str(value)


def minimal_spec():
    """The spec built from only the keys that have no default: what every other key defaults to
    when the YAML leaves it out (spec/build.py), top-level keys included."""
    from batchspec.spec.build import build_spec

    return build_spec(
        {
            "input": {"path": "in/*.parquet", "prompt_column": "prompt"},
            "output": {"path": "out"},
            "model": {"target": "model"},
        }
    )


def spec_markdown() -> str:
    """The keys of the job spec, section by section, each with its type, default and meaning."""
    from batchspec.spec import model

    comments = field_comments(Path(model.__file__))
    built = minimal_spec()
    out: list[str] = []
    missing: list[str] = []

    def section(cls, prefix: str, title: str, defaults_from, note: str = "") -> None:
        hints = typing.get_type_hints(cls)
        nested = []
        out.append(f"## {title}\n")
        doc = "" if cls is model.JobSpec else yaml_words(markdown(" ".join((cls.__doc__ or "").split())))
        for text in (note, doc):
            if text:
                out.append(f"{text}\n")
        for f in dataclasses.fields(cls):
            qual = f"{cls.__name__}.{f.name}"
            if qual in NOT_KEYS:
                continue
            dotted = prefix + YAML_NAMES.get(qual, f.name)
            tp = hints[f.name]
            inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
            text = comments.get(qual)
            if inner:  # a section of its own, after this one's keys
                nested.append((inner[0], dotted, text))
                continue
            if not text:
                missing.append(f"{dotted} ({qual} in batchspec/spec/model.py)")
                continue
            if qual in LISTS:
                constant, what = LISTS[qual]
                text += f" {what}: " + ", ".join(f"`{v}`" for v in getattr(model, constant)) + "."
            if f.default is not dataclasses.MISSING:
                default = f"default `{yaml_value(f.default)}`"
            elif f.default_factory is not dataclasses.MISSING:
                default = f"default `{yaml_value(f.default_factory())}`"
            elif defaults_from is not None:
                default = f"default `{yaml_value(getattr(defaults_from, f.name))}`"
            else:
                default = "**required**"
            out.append(f"### `{dotted}` {{#{dotted}}}\n")
            out.append(f"*{YAML_TYPES.get(qual, type_name(tp))}* · {default}\n")
            out.append(f"{yaml_words(markdown(text))}\n")
        for inner_cls, dotted, text in nested:
            # speculative_auto's comment is about the parsed spec; the class says what to write
            notes = [yaml_words(markdown(text))] if text and inner_cls is not model.AutoSpeculation else []
            if cls is model.JobSpec and inner_cls is not model.AutoSpeculation:
                required = any(
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    for f in dataclasses.fields(inner_cls)
                )
                notes.append(
                    "A required section."
                    if required
                    else "An optional section: left out, each of its keys takes its default."
                )
            title = "`speculative: auto`" if inner_cls is model.AutoSpeculation else f"`{dotted}`"
            section(inner_cls, f"{dotted}.", title, None, " ".join(notes))

    section(model.JobSpec, "", "Top-level keys", built)
    if missing:
        raise MissingDescription(
            "spec keys with no `#:` comment in batchspec/spec/model.py: " + ", ".join(missing)
        )
    return "\n".join(out)


# ------------------------------------------------------------------------------ columns


def arrow_type(tp) -> str:
    """A pyarrow type in the contract's short form: ``list<struct<token_id int32, ...>>``."""
    import pyarrow as pa

    if pa.types.is_list(tp) or pa.types.is_large_list(tp):
        return f"list<{arrow_type(tp.value_type)}>"
    if pa.types.is_struct(tp):
        return (
            "struct<"
            + ", ".join(f"{tp.field(i).name} {arrow_type(tp.field(i).type)}" for i in range(tp.num_fields))
            + ">"
        )
    return {"double": "float64", "float": "float32"}.get(str(tp), str(tp))


#: Each task's result columns (batchspec/tasks.py), as the column reference lists them: the
#: list in batchspec/columns.py, and its heading.
TASK_COLUMNS = (
    ("RESULT_FIELDS", "Generation (`task: generate`, the default)"),
    ("EMBED_FIELDS", "Embeddings (`task: embed`)"),
    ("CLASSIFY_FIELDS", "Classification (`task: classify`)"),
    ("SCORE_FIELDS", "Scoring (`task: score`)"),
)


def columns_markdown() -> str:
    """The output columns, in the order an output file has them: one table a task."""
    from batchspec import columns, tasks

    comments = field_comments(Path(columns.__file__))
    missing = []
    request_id = comments.get("REQUEST_ID")
    if not request_id:
        missing.append(columns.REQUEST_ID)
    listed = {name for name, _ in TASK_COLUMNS}
    unlisted = [
        t.name
        for t in tasks.TASKS.values()
        if not any(list(t.result_fields) == list(getattr(columns, name)) for name in listed)
    ]
    if unlisted:
        raise MissingDescription(f"tasks with no table in TASK_COLUMNS: {', '.join(unlisted)}")
    out = []
    for list_name, title in TASK_COLUMNS:
        described = column_comments(Path(columns.__file__), vars(columns), list_name)
        rows = [f"### {title}", "", "| column | type | meaning |", "| --- | --- | --- |"]
        rows.append(f"| `{columns.REQUEST_ID}` | string | {markdown(request_id or '')} |")
        rows.append(
            "| kept input columns | as in the input | what "
            "[`output.keep_columns`](spec.md#output.keep_columns) keeps |"
        )
        for f in getattr(columns, list_name):
            text = described.get(f.name)
            if not text:
                missing.append(f.name)
                continue
            rows.append(f"| `{f.name}` | `{arrow_type(f.type)}` | {markdown(text)} |")
        out.append("\n".join(rows) + "\n")
    if missing:
        raise MissingDescription(
            "output columns with no `#:` comment in batchspec/columns.py: " + ", ".join(missing)
        )
    return "\n".join(out)


# ------------------------------------------------------------------------------ the hook

GENERATED = {
    "reference/spec.md": (SPEC_MARKER, spec_markdown),
    "reference/columns.md": (COLUMNS_MARKER, columns_markdown),
}


def on_page_markdown(markdown_text: str, page, config, files) -> str:
    """Replace a reference page's marker with what the code says."""
    from mkdocs.exceptions import PluginError

    entry = GENERATED.get(page.file.src_uri)
    if entry is None:
        return markdown_text
    marker, generate = entry
    if marker not in markdown_text:
        raise PluginError(f"{page.file.src_uri}: the marker {marker} is missing")
    try:
        return markdown_text.replace(marker, generate())
    except MissingDescription as exc:
        raise PluginError(str(exc)) from exc


if __name__ == "__main__":
    print(spec_markdown() if sys.argv[1:] == ["spec"] else columns_markdown())
