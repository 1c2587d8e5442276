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
import json
import re
from collections.abc import Mapping
from typing import Any

#: The constraint kinds, by vLLM's field names.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: StructuredOutputsParams fields vLLM's backends ignore on a request (they read the engine's
#: ``structured_outputs_config``): refused in a constraint rather than silently dropped.
ENGINE_WIDE = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
#: ``input.sampling_columns`` keys that give one field of the constraint per row.
FIELD_COLUMNS = tuple(f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar"))
#: Every ``input.sampling_columns`` key about structured outputs.
COLUMN_KEYS = ("structured_outputs", *FIELD_COLUMNS)


class ConstraintError(ValueError):
    """A constraint that vLLM would refuse, with the reason."""


def normalise(value: Any) -> dict[str, Any]:
    """A constraint as a plain mapping: JSON text is parsed; a ``json`` schema given as JSON text
    is parsed too. Raises ConstraintError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"not JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise ConstraintError(f"expected a mapping with one of {', '.join(KINDS)}, "
                              f"got {type(value).__name__}")
    # an Arrow struct column gives every field, the unused ones null
    out = {k: v for k, v in value.items() if v is not None}
    engine_wide = [k for k in ENGINE_WIDE if k in out]
    if engine_wide:
        raise ConstraintError(
            f"{engine_wide[0]}: vLLM applies it to the whole engine, not per request (a "
            "request's own value is ignored); set model.engine.structured_outputs_config."
            f"{engine_wide[0]} instead")
    unknown = sorted(set(out) - set(KINDS))
    if unknown:
        raise ConstraintError(f"unknown key(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(KINDS)})")
    kinds = [k for k in KINDS if k in out]
    if len(kinds) != 1:
        raise ConstraintError(f"exactly one of {', '.join(KINDS)} must be set, got "
                              f"{', '.join(kinds) or 'none'}")
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
        if isinstance(choice, str) or not isinstance(choice, list | tuple) or not choice \
                or not all(isinstance(c, str) and c for c in choice):
            raise ConstraintError("choice: expected a non-empty list of non-empty strings")
        out["choice"] = list(choice)
    if "regex" in out:
        if not isinstance(out["regex"], str):
            raise ConstraintError("regex: expected a string")
        try:
            re.compile(out["regex"])
        except re.error as exc:
            raise ConstraintError(f"regex: {exc}") from exc
    if "json_object" in out and out["json_object"] is not True:
        raise ConstraintError("json_object: must be true (leave structured_outputs out to turn "
                              "it off)")
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
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(f"json: not a valid JSON schema: {exc.message}") from exc


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


def check_output(constraint: Mapping[str, Any], text: str | None, finish_reason: str | None
                 ) -> tuple[bool, str | None]:
    """(valid, why not) for a finished output: valid when it finished with ``stop`` and its text
    satisfies its own constraint. A ``grammar`` constraint is trusted to vLLM's backend: its
    output is valid when it finished with ``stop``."""
    if text is None or finish_reason in ("error", "abort"):
        return False, f"no complete output (finish_reason {finish_reason})"
    if finish_reason != "stop":
        return False, f"cut before the constraint was complete (finish_reason {finish_reason})"
    if "choice" in constraint:
        return (True, None) if text in constraint["choice"] else (False, "not one of the choices")
    if "regex" in constraint:
        return (True, None) if re.fullmatch(constraint["regex"], text) \
            else (False, "does not match the regex")
    if "json" in constraint or "json_object" in constraint:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return False, f"not JSON: {exc}"
        if "json_object" in constraint:
            return (True, None) if isinstance(value, dict) else (False, "not a JSON object")
        import jsonschema

        validator = jsonschema.validators.validator_for(constraint["json"])(constraint["json"])
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(root)"
            return False, f"schema: at {where}: {error.message}"[:300]
        return True, None
    return True, None
