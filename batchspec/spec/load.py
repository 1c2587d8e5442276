"""The job spec: load YAML, expand ``${VAR}``, apply ``--set``, validate, explain errors.

Every error is a :class:`~batchspec.errors.SpecError` naming the dotted key at fault. Keys that
vLLM owns (``model.engine``, ``speculative``, ``sampling``) keep vLLM's own names and are checked
against vLLM's own config classes by :mod:`batchspec.engine.llm`, so users learn one vocabulary."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.spec.fields import kind_of
from batchspec.spec.model import JobSpec

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


#: A YAML document (job spec or ``--set`` value) may hold at most this many nodes, counted as if
#: every alias were a copy of what it names: an alias bomb is refused before it is built.
MAX_YAML_NODES = 10_000


#: ... and use at most this many aliases (``*name``, merges ``<<: *name`` included).
MAX_YAML_ALIASES = 100


# --------------------------------------------------------------------------- loading


def load_spec(
    path: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> JobSpec:
    """Read a YAML job spec, expand ``${VAR}``, apply ``--set`` overrides and validate it."""
    environ = os.environ if environ is None else environ
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(None, f"cannot read job spec {path}: {exc.strerror or exc}") from exc
    raw = load_yaml(text, str(path), environ)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(None, f"{path}: the job spec must be a mapping of keys, not {kind_of(raw)}")
    for item in overrides:
        apply_override(raw, item, environ)
    # Only now: a variable is needed only if no --set replaced the value that names it.
    _raise_unset(raw)
    return build_spec(raw)


def apply_override(raw: dict, item: str, environ: Mapping[str, str] | None = None) -> None:
    """Apply one ``--set a.b=value``: the value is read as YAML, with ``${VAR}`` expanded and
    typed as in the job file and the same limits on aliases."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError(
            None, f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set sampling.max_tokens=32"
        )
    parts = key.split(".")
    if value.strip():
        parsed = load_yaml(value, f"--set {key}", os.environ if environ is None else environ, key_path=key)
    else:
        parsed = ""
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(
                ".".join(parts[: i + 1]), f"--set {key}: this key holds {kind_of(child)}, not a mapping"
            )
        node = child
    node[parts[-1]] = parsed


# --------------------------------------------------------------------------- YAML


class _Unset:
    """Placeholder for a value that names an unset ``${VAR}``: an error only if it survives
    the ``--set`` overrides."""

    __slots__ = ("key", "name")

    def __init__(self, key: str, name: str):
        self.key, self.name = key, name

    def error(self) -> SpecError:
        return SpecError(
            self.key or None,
            f"${{{self.name}}} is not set in the environment (use ${{{self.name}:-default}} for a default)",
        )


class _Refused(Exception):
    """A YAML document over the alias or size limits (turned into a SpecError)."""


_UNSET_TAG = "tag:batchspec,2026:unset-variable"


_STR_TAG = "tag:yaml.org,2002:str"


#: What an expanded plain scalar may become: YAML's null, bool, int and float. A timestamp stays
#: a string: dates are what schedulers template most, and they name paths and runs.
_TYPED_TAGS = frozenset(
    {"tag:yaml.org,2002:null", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
)


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that expands ``${VAR}`` in scalar values as it composes them, types a plain
    scalar by what it expanded to, and counts aliases and the expanded size of the document."""

    def __init__(self, stream: str, environ: Mapping[str, str], key_path: str = ""):
        super().__init__(stream)
        self.environ = environ
        self.path: list[str] = [key_path] if key_path else []
        self.alias_uses = 0
        self.composing_key = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.alias_uses += 1
            if self.alias_uses > MAX_YAML_ALIASES:
                raise _Refused(
                    f"more than {MAX_YAML_ALIASES} YAML aliases (*name); write the repeated values out"
                )
            return super().compose_node(parent, index)
        if isinstance(parent, MappingNode) and index is None:
            self.composing_key += 1  # keys are never expanded
            try:
                return super().compose_node(parent, index)
            finally:
                self.composing_key -= 1
        if isinstance(parent, MappingNode):
            segment = str(index.value) if isinstance(index, ScalarNode) else "?"
            segment = f".{segment}" if self.path else segment
        elif isinstance(parent, SequenceNode):
            segment = f"[{index}]"
        else:
            return super().compose_node(parent, index)
        self.path.append(segment)
        try:
            return super().compose_node(parent, index)
        finally:
            self.path.pop()

    def compose_scalar_node(self, anchor):
        event = self.peek_event()
        if self.composing_key or "${" not in event.value:
            return super().compose_scalar_node(anchor)
        event = self.get_event()
        key = "".join(self.path)
        unset: list[str] = []

        def sub(match: re.Match) -> str:
            name, default = match.group(1), match.group(2)
            if name in self.environ:
                return self.environ[name]
            if default is not None:
                return default
            unset.append(name)
            return ""

        value = _VAR.sub(sub, event.value)
        tag = event.tag
        if unset:
            tag, value = _UNSET_TAG, f"{key}\0{unset[0]}"
        elif tag is None or tag == "!":
            if event.implicit[0]:  # plain: typed by what it expanded to, as YAML would
                tag = self.resolve(ScalarNode, value, (True, False))
                tag = tag if tag in _TYPED_TAGS else _STR_TAG
            else:  # quoted or block: a string
                tag = _STR_TAG
        node = ScalarNode(tag, value, event.start_mark, event.end_mark, style=event.style)
        if anchor is not None:
            self.anchors[anchor] = node
        return node

    def compose_document(self):
        node = super().compose_document()
        size = _expanded_size(node)
        if size > MAX_YAML_NODES:
            raise _Refused(
                f"it expands to {size:,} nodes when its aliases are copied, more "
                f"than {MAX_YAML_NODES:,} (an alias bomb?)"
            )
        return node


def _expanded_size(root) -> int:
    """Nodes in the document as if every alias were copied: memoised on the node graph, so it
    takes as long as the document is written, never as long as it would expand."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        ident = id(node)
        if ident in memo:
            return memo[ident]
        if ident in active:
            raise _Refused("an alias refers to a node that contains it (a recursive document)")
        active.add(ident)
        total = 1
        if isinstance(node, SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        active.discard(ident)
        memo[ident] = total
        return total

    return size(root)


def load_yaml(text: str, source: str, environ: Mapping[str, str], key_path: str = "") -> Any:
    """Parse YAML as the job spec reads it: safe tags only, ``${VAR}`` expanded and typed, at
    most :data:`MAX_YAML_ALIASES` aliases and :data:`MAX_YAML_NODES` nodes after expansion.

    ``source`` names the file (or ``--set KEY``) in errors; ``key_path`` is the dotted key the
    document sits at, for errors about unset variables. The result shares no containers, even
    where the document used an anchor twice. An unset variable is left as a placeholder that
    :func:`load_spec` reports unless an override replaced it."""
    loader = _SpecLoader(text, environ, key_path)
    try:
        data = loader.get_single_data()
    except _Refused as exc:
        raise SpecError(key_path or None, f"{source}: refused: {exc}") from None
    except RecursionError:
        raise SpecError(key_path or None, f"{source}: refused: the YAML is nested too deeply") from None
    except yaml.YAMLError as exc:
        what = "value is not valid YAML" if key_path else "not valid YAML"
        raise SpecError(key_path or None, f"{source}: {what}: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()
    return unshared(data)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without PyYAML's quote of the line: it may hold a credential."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem is None:
        return type(exc).__name__
    where = ""
    if exc.problem_mark is not None:
        where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
    context = f" ({exc.context})" if exc.context else ""
    return f"{exc.problem}{where}{context}"


def unshared(value: Any) -> Any:
    """A copy in which no two places share a mapping or list (an anchor used twice gives two),
    so that ``--set`` on one key never changes another. Bounded by MAX_YAML_NODES."""
    if isinstance(value, dict):
        return {k: unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unshared(v) for v in value]
    return value


def _raise_unset(value: Any) -> None:
    """Raise the error of the first ``${VAR}`` that is unset and still in the spec."""
    if isinstance(value, _Unset):
        raise value.error()
    if isinstance(value, dict):
        for item in value.values():
            _raise_unset(item)
    elif isinstance(value, list):
        for item in value:
            _raise_unset(item)


_SpecLoader.add_constructor(_UNSET_TAG, lambda loader, node: _Unset(*node.value.split("\0", 1)))
