"""Structured outputs (vLLM's ``structured_outputs``): the constraint a job or a row asks for,
checked before any weights load, and each finished output checked against its own constraint.

A constraint is a mapping with vLLM's names: exactly one of ``json`` (a JSON schema, as a mapping
or JSON text), ``json_object`` (true), ``regex``, ``choice`` (a list of strings) or ``grammar``
(EBNF or Lark). vLLM's whitespace and additional-properties options are engine-wide: vLLM 0.32's
backends read them from the engine's ``structured_outputs_config`` and ignore a request's own, so
a constraint that sets one is refused (set ``model.engine.structured_outputs_config`` instead).
It comes job-wide from ``sampling.structured_outputs`` or per row from an input column named in
``input.sampling_columns`` under ``structured_outputs`` (the whole mapping, as JSON text or a
struct) or ``structured_outputs.json``/``.regex``/``.choice``/``.grammar`` (that one field)."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from batchspec.errors import quoted

#: The constraint kinds, by vLLM's field names.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: StructuredOutputsParams fields vLLM's backends ignore on a request (they read the engine's
#: ``structured_outputs_config``): refused in a constraint rather than silently dropped.
ENGINE_WIDE = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
#: ``input.sampling_columns`` keys that give one field of the constraint per row.
FIELD_COLUMNS = tuple(f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar"))
#: Every ``input.sampling_columns`` key about structured outputs.
COLUMN_KEYS = ("structured_outputs", *FIELD_COLUMNS)


#: The deepest a JSON schema may nest (objects and lists): deeper, its own check recurses past
#: Python's limit (a 3 KB schema nested 100 deep did).
MAX_SCHEMA_DEPTH = 64
#: The most objects and arrays a JSON schema may hold once each ``$ref`` is replaced by what it
#: points at, as the output check (jsonschema) and the typed answer column follow them. A
#: definition that refers twice to the next doubles at each level: a 1 KB schema of 16 levels
#: took 17 s to check one output against, 2 KB of 20 levels 35 s to type.
MAX_SCHEMA_NODES = 20_000


class ConstraintError(ValueError):
    """A constraint that vLLM would refuse, with the reason."""


# ---------------------------------------------------------------------------- regular expressions


@functools.cache
def _re2_options():
    import re2

    options = re2.Options()
    options.log_errors = False  # RE2 would print every refused pattern to stderr
    return options


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str):
    """``pattern`` compiled by RE2, which matches in time linear in the text (no backtracking:
    ``(a+)+b`` against 40 characters takes microseconds, not hours, and holds no lock long
    enough to starve another thread). ConstraintError for a pattern RE2 does not take
    (backreferences, lookarounds: what a constraint's grammar cannot express either)."""
    import re2

    try:
        return re2.compile(pattern, _re2_options())
    except re2.error as exc:
        raise ConstraintError(
            f"regex: {pattern[:80]!r} is not a regular expression batchspec "
            f"checks in linear time (RE2 syntax): {_text(exc)}"
        ) from exc


def _text(exc: BaseException) -> str:
    arg = exc.args[0] if exc.args else exc
    return arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)


def normalise(value: Any) -> dict[str, Any]:
    """A constraint as a plain mapping: JSON text is parsed; a ``json`` schema given as JSON text
    is parsed too. Raises ConstraintError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"not JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise ConstraintError(
            f"expected a mapping with one of {', '.join(KINDS)}, got {type(value).__name__}"
        )
    # an Arrow struct column gives every field, the unused ones null
    out = {k: v for k, v in value.items() if v is not None}
    engine_wide = [k for k in ENGINE_WIDE if k in out]
    if engine_wide:
        raise ConstraintError(
            f"{engine_wide[0]}: vLLM applies it to the whole engine, not per request (a "
            "request's own value is ignored); set model.engine.structured_outputs_config."
            f"{engine_wide[0]} instead"
        )
    unknown = sorted(set(out) - set(KINDS))
    if unknown:
        raise ConstraintError(f"unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(KINDS)})")
    kinds = [k for k in KINDS if k in out]
    if len(kinds) != 1:
        raise ConstraintError(
            f"exactly one of {', '.join(KINDS)} must be set, got {', '.join(kinds) or 'none'}"
        )
    if isinstance(out.get("json"), str):
        try:
            out["json"] = json.loads(out["json"])
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"json: the schema is not JSON: {exc}") from exc
    if "json" in out:
        if not isinstance(out["json"], Mapping):
            raise ConstraintError("json: a JSON schema must be an object")
        _check_schema(out["json"])
    if "choice" in out:
        choice = out["choice"]
        if (
            isinstance(choice, str)
            or not isinstance(choice, list | tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise ConstraintError("choice: expected a non-empty list of non-empty strings")
        out["choice"] = list(choice)
    if "regex" in out:
        if not isinstance(out["regex"], str):
            raise ConstraintError("regex: expected a string")
        compile_regex(out["regex"])
    if "json_object" in out and out["json_object"] is not True:
        raise ConstraintError("json_object: must be true (leave structured_outputs out to turn it off)")
    if "grammar" in out and (not isinstance(out["grammar"], str) or not out["grammar"].strip()):
        raise ConstraintError("grammar: expected a non-empty string")
    return out


def from_row(base: Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> dict | None:
    """The constraint of one row: the job's, replaced by the row's whole-constraint column, or by
    one field from a ``structured_outputs.<kind>`` column."""
    constraint = dict(base) if base else None
    if "structured_outputs" in overrides:
        constraint = normalise(overrides["structured_outputs"])
    for key in FIELD_COLUMNS:
        if key in overrides:
            kind = key.split(".", 1)[1]
            constraint = normalise({kind: overrides[key]})
    return constraint


def _check_schema(schema: Mapping[str, Any]) -> None:
    """A schema batchspec can check outputs against, safely: at most :data:`MAX_SCHEMA_DEPTH`
    deep, every reference (:data:`REFERENCES`) local and acyclic, every ``$schema`` a
    meta-schema jsonschema knows and every ``$id`` local (nothing outside the schema is ever
    resolved), at most :data:`MAX_SCHEMA_NODES` objects and arrays with every reference
    followed, every ``pattern`` an RE2 expression, and valid under its own meta-schema."""
    import jsonschema

    refs, names, patterns = _keywords(schema)
    _check_names(names)
    _check_refs(schema, refs)
    for pattern in patterns:
        compile_regex(pattern)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(f"json: not a valid JSON schema: {exc.message}") from exc
    except Exception as exc:  # noqa: BLE001 (a schema no meta-schema check copes with)
        raise ConstraintError(f"json: cannot check the schema: {type(exc).__name__}: {exc}") from exc


#: Keywords whose values map names to schemas: a name there (a property called "pattern" or
#: "$ref") is no keyword.
_NAMED = ("properties", "$defs", "definitions")
#: The keywords jsonschema follows to another schema when it checks an output: each must point
#: into the schema itself (``#`` or ``#/...``), never at a URL.
REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")
#: The keywords that name a schema by URI: ``$schema`` must be a meta-schema jsonschema knows
#: (it is never fetched), ``$id`` local (``#...``), so that no reference resolves outside the
#: schema.
_NAMES = ("$schema", "$id")

#: Where a keyword is (a JSON pointer's parts), the keyword, and the mapping holding it or its value.
_Found = list[tuple[tuple, str, Any]]


def _keywords(schema: Any) -> tuple[_Found, _Found, list[str]]:
    """One pass over a schema, with a stack of its own (never Python's): ConstraintError where
    it nests deeper than :data:`MAX_SCHEMA_DEPTH`; else each reference (where it is, as a JSON
    pointer's parts, its keyword and the mapping that holds it), each ``$schema`` and ``$id``
    (where, keyword, value) and the regular expressions of ``pattern`` and
    ``patternProperties``."""
    refs: _Found = []
    names: _Found = []
    patterns: list[str] = []
    stack: list[tuple[tuple, Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if len(path) >= MAX_SCHEMA_DEPTH:  # the root is the first level
            raise ConstraintError(f"json: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, Mapping):
            if not path or path[-1] not in _NAMED:
                refs.extend((path, keyword, node) for keyword in REFERENCES if keyword in node)
                names.extend((path, keyword, node[keyword]) for keyword in _NAMES if keyword in node)
                if isinstance(node.get("pattern"), str):
                    patterns.append(node["pattern"])
                if isinstance(node.get("patternProperties"), Mapping):
                    patterns.extend(k for k in node["patternProperties"] if isinstance(k, str))
            children = node.items()
        else:
            children = enumerate(node)
        stack.extend(((*path, k), v) for k, v in children if isinstance(v, Mapping | list | tuple))
    return refs, names, patterns


def _where(path: tuple) -> str:
    return "/".join(map(str, path)) or "(root)"


def _check_names(names: _Found) -> None:
    """Each ``$schema`` names a meta-schema jsonschema holds (draft 3 to 2020-12, never
    fetched), each ``$id`` is local (``#...``): a schema that names a URL as its meta-schema
    or as its own base is refused, as a remote reference is."""
    import jsonschema

    for path, keyword, value in names:
        if keyword == "$schema":
            known = isinstance(value, str) and jsonschema.validators.validator_for({keyword: value}, None)
            if not known:
                raise ConstraintError(
                    f"json: $schema {quoted(value)} at {_where(path)}: not a meta-schema batchspec "
                    "knows (json-schema.org's draft-03 to 2020-12); batchspec fetches no schema"
                )
        elif not isinstance(value, str) or not value.startswith("#"):
            raise ConstraintError(
                f"json: $id {quoted(value)} at {_where(path)}: only local identifiers ('#...') are "
                "supported; batchspec resolves nothing outside the schema"
            )


def _check_refs(schema: Any, refs: _Found) -> None:
    """Every reference (from :func:`_keywords`) is a JSON pointer into this schema (``#`` or
    ``#/...``) that resolves, no chain of them leads back into itself, and the schema with them
    followed stays within :data:`MAX_SCHEMA_NODES`: a schema that refers to the network, to
    itself (``{"$ref": "#"}``) or to one definition along too many paths is refused."""
    # id of a reference's mapping: (keyword, target's path, target) for each it holds
    targets: dict[int, list[tuple[str, tuple, Any]]] = {}
    for path, keyword, holder in refs:
        ref = holder[keyword]
        where = _where(path)
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ConstraintError(
                f"json: {keyword} {quoted(ref)} at {where}: only local references ('#/...') are supported"
            )
        targets.setdefault(id(holder), []).append((keyword, *_resolve(schema, ref, keyword, where)))
    _check_expanded(schema, targets)


def _check_expanded(schema: Any, targets: dict[int, list[tuple[str, tuple, Any]]]) -> None:
    """Count the objects and arrays of the schema with each reference replaced by its target,
    without replacing any: each node's count is kept (by identity), so a definition reached
    along many paths is counted once and added at each. Linear in the schema's size, with a
    stack of its own. ConstraintError on a cycle of references or past the limit."""
    counts: dict[int, int] = {}

    def children(node: Any) -> Iterator[tuple[tuple[str, tuple] | None, Any]]:
        values = node.values() if isinstance(node, Mapping) else node
        yield from ((None, v) for v in values if isinstance(v, Mapping | list | tuple))
        for keyword, path, target in targets.get(id(node), ()):
            if isinstance(target, Mapping | list | tuple):
                yield (keyword, path), target

    on_path = {id(schema)}
    stack = [[schema, children(schema), 1]]  # a node, its children left, its count so far
    while stack:
        frame = stack[-1]
        via, child = next(frame[1], (None, None))
        if child is None:
            stack.pop()
            on_path.discard(id(frame[0]))
            counts[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
        elif id(child) in counts:
            frame[2] += counts[id(child)]
        elif id(child) in on_path:  # only a reference leads back up the tree
            keyword, target_path = via
            raise ConstraintError(
                f"json: {keyword} cycle through '#"
                + "".join(f"/{p}" for p in target_path)
                + "': recursive schemas are not supported"
            )
        else:
            on_path.add(id(child))
            stack.append([child, children(child), 1])
        # a count only grows on the way up: past the limit anywhere, past it at the root
        if stack and stack[-1][2] > MAX_SCHEMA_NODES:
            raise ConstraintError(
                f"json: with each $ref replaced by what it points at, the schema holds more than "
                f"{MAX_SCHEMA_NODES:,} objects and arrays (a reference reached along many paths "
                "multiplies: a definition that refers twice to the next doubles it at each level)"
            )


def _resolve(schema: Any, ref: str, keyword: str, where: str) -> tuple[tuple, Any]:
    """What a local reference points at: its path and the node there."""
    node, path = schema, []
    for raw in ref[2:].split("/") if ref != "#" else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node, key = node[part], part
        elif isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            node, key = node[int(part)], int(part)
        else:
            raise ConstraintError(f"json: {keyword} {quoted(ref)} at {where} points at nothing in the schema")
        path.append(key)
    return tuple(path), node


def vllm_params(constraint: Mapping[str, Any]):
    """vLLM's StructuredOutputsParams for a (normalised) constraint."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**copy.deepcopy(dict(constraint)))


def check_with_vllm(constraint: Mapping[str, Any]) -> None:
    """Compile the constraint as vLLM's ``auto`` backend would (xgrammar, else guidance), without
    a model: ConstraintError with vLLM's reason when neither takes it."""
    from vllm import SamplingParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        xgrammar_error = None
        validate_xgrammar_grammar(SamplingParams(structured_outputs=vllm_params(constraint)))
    except Exception as exc:  # xgrammar refuses; vLLM's auto backend falls back to guidance
        xgrammar_error = exc
    if xgrammar_error is None:
        return
    try:
        validate_guidance_grammar(SamplingParams(structured_outputs=vllm_params(constraint)))
    except Exception as exc:
        raise ConstraintError(f"vLLM cannot compile it: {xgrammar_error}; {exc}") from exc


# ---------------------------------------------------------------------------- outputs


def check_output(
    constraint: Mapping[str, Any], text: str | None, finish_reason: str | None
) -> tuple[bool, str | None]:
    """(valid, why not) for a finished output: valid when it finished with ``stop`` and its text
    satisfies its own constraint. A ``grammar`` constraint is trusted to vLLM's backend: its
    output is valid when it finished with ``stop``. Never raises, and takes time linear in the
    text: a regex (the constraint's, or a schema's ``pattern``) is matched by RE2."""
    valid, why, _ = check_answer(constraint, text, finish_reason)
    return valid, why


#: :func:`check_answer`'s answer where there is none (an invalid output, a regex or grammar).
NO_ANSWER = None


def check_answer(
    constraint: Mapping[str, Any], text: str | None, finish_reason: str | None
) -> tuple[bool, str | None, Any]:
    """:func:`check_output`, with the answer of a valid output: the parsed JSON value
    (``json``, ``json_object``) or the chosen label (``choice``); None otherwise (what
    ``output.parse_json`` writes, batchspec/io/answers.py)."""
    try:
        return _check_output(constraint, text, finish_reason)
    except Exception as exc:  # noqa: BLE001 (an output nested past the recursion limit, ...)
        return False, f"cannot check the output: {type(exc).__name__}: {exc}"[:300], NO_ANSWER


def _check_output(
    constraint: Mapping[str, Any], text: str | None, finish_reason: str | None
) -> tuple[bool, str | None, Any]:
    if text is None or finish_reason in ("error", "abort"):
        return False, f"no complete output (finish_reason {finish_reason})", NO_ANSWER
    if finish_reason != "stop":
        return False, f"cut before the constraint was complete (finish_reason {finish_reason})", NO_ANSWER
    if "choice" in constraint:
        if text in constraint["choice"]:
            return True, None, text
        return False, "not one of the choices", NO_ANSWER
    if "regex" in constraint:
        if compile_regex(constraint["regex"]).fullmatch(text):
            return True, None, NO_ANSWER
        return False, "does not match the regex", NO_ANSWER
    if "json" in constraint or "json_object" in constraint:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return False, f"not JSON: {exc}", NO_ANSWER
        if "json_object" in constraint:
            if isinstance(value, dict):
                return True, None, value
            return False, "not a JSON object", NO_ANSWER
        import jsonschema

        validator = _validator_class(constraint["json"])(constraint["json"], registry=_no_retrieval())
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(root)"
            return False, f"schema: at {where}: {error.message}"[:300], NO_ANSWER
        return True, None, value
    return True, None, NO_ANSWER


def _validator_class(schema: Mapping[str, Any]):
    """jsonschema's validator for the schema's draft, its regular expressions matched by RE2."""
    import jsonschema

    _jsonschema_on_re2()
    return jsonschema.validators.validator_for(schema)


def _refuse_retrieval(uri: str):
    raise LookupError(f"batchspec retrieves no schema ({uri[:200]}): only local references are followed")


@functools.cache
def _no_retrieval():
    """jsonschema's registry for checking outputs: the meta-schemas it holds, and nothing it
    may retrieve (its default fetches any URI a reference names, with urllib and no timeout).
    A reference :func:`normalise` let through that points outside the schema is then that
    output's ``cannot check the output``, never a request."""
    from referencing import Registry

    return Registry(retrieve=_refuse_retrieval)


class _Re2Search:
    """What jsonschema's keyword modules use of :mod:`re` (``search``), by RE2; the rest of the
    module as it is."""

    def __getattr__(self, name: str):
        import re

        return getattr(re, name)

    @staticmethod
    def search(pattern, string, flags=0):
        if flags or not isinstance(pattern, str):
            import re

            return re.search(pattern, string, flags)
        return compile_regex(pattern).search(string)


@functools.cache
def _jsonschema_on_re2() -> None:
    """jsonschema matches ``pattern``, ``patternProperties`` and ``additionalProperties`` with
    Python's backtracking ``re.search`` in three modules; a model's output is then checked in
    time exponential in its length (``(a+)+b``). Those modules' ``re`` becomes RE2's search
    (every pattern a constraint holds was compiled by RE2 when it was checked)."""
    import importlib

    for name in ("jsonschema._keywords", "jsonschema._utils", "jsonschema._legacy_keywords"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "re", None) is not None:
            module.re = _Re2Search()
