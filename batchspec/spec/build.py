"""Build a :class:`JobSpec` from the parsed YAML: check every key and value, with errors that name
the key (exit 2); defaults come from the dataclasses in spec/model.py."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from batchspec.errors import SpecError
from batchspec.spec.model import (
    EXECUTOR_KINDS,
    ROW_OVERRIDABLE,
    ExecutionSpec,
    ExecutorSpec,
    InputSpec,
    JobSpec,
    ModelSpec,
    OutputSpec,
)

# --------------------------------------------------------------------------- validation

_TOP_KEYS = ("name", "input", "output", "model", "speculative", "sampling", "execution",
             "executor")




def build_spec(raw: dict[str, Any]) -> JobSpec:
    """Validate a resolved spec mapping and build the typed :class:`JobSpec`."""
    _check_keys(raw, _TOP_KEYS, "")
    name = _get(raw, "name", str, "", default="batchspec")

    inp = _section(raw, "input", required=True)
    _check_keys(inp, ("path", *(f.name for f in dataclasses.fields(InputSpec) if f.name != "paths")),
                "input")
    paths = _get(inp, "path", (str, list), "input", required=True)
    paths = [paths] if isinstance(paths, str) else paths
    if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise SpecError("input.path", "expected a non-empty URL or glob, or a list of them")
    prompt_column = _get(inp, "prompt_column", str, "input")
    messages_column = _get(inp, "messages_column", str, "input")
    if bool(prompt_column) == bool(messages_column):
        raise SpecError("input.prompt_column",
                        "give exactly one of input.prompt_column (text) and "
                        "input.messages_column (chat messages)")
    sampling_columns = _get(inp, "sampling_columns", dict, "input",
                            default=_default(InputSpec, "sampling_columns"))
    for k, v in sampling_columns.items():
        if k not in ROW_OVERRIDABLE:
            raise SpecError(f"input.sampling_columns.{k}",
                            f"not a per-row SamplingParams field{_suggest(k, ROW_OVERRIDABLE)}; "
                            f"one of: {', '.join(ROW_OVERRIDABLE)}")
        if not isinstance(v, str) or not v:
            raise SpecError(f"input.sampling_columns.{k}", "expected the name of an input column")
    on_bad_shard = _get(inp, "on_bad_shard", str, "input", default=_default(InputSpec, "on_bad_shard"))
    if on_bad_shard not in ("fail", "skip"):
        raise SpecError("input.on_bad_shard", f"expected 'fail' or 'skip', got {on_bad_shard!r}")
    allow_empty = _get(inp, "allow_empty", bool, "input", default=_default(InputSpec, "allow_empty"))
    input_spec = InputSpec(
        paths=tuple(paths),
        prompt_column=prompt_column,
        messages_column=messages_column,
        id_column=_get(inp, "id_column", str, "input"),
        sampling_columns=dict(sampling_columns),
        storage_options=_get(inp, "storage_options", dict, "input",
                             default=_default(InputSpec, "storage_options")),
        on_bad_shard=on_bad_shard,
        allow_empty=allow_empty,
    )

    out = _section(raw, "output", required=True)
    _check_keys(out, [f.name for f in dataclasses.fields(OutputSpec)], "output")
    keep = _get(out, "keep_columns", list, "output")
    if keep is not None and not all(isinstance(c, str) and c for c in keep):
        raise SpecError("output.keep_columns", "expected a list of column names")
    output_spec = OutputSpec(
        path=_get(out, "path", str, "output", required=True),
        keep_columns=tuple(keep) if keep is not None else None,
        storage_options=_get(out, "storage_options", dict, "output",
                             default=_default(OutputSpec, "storage_options")),
        row_group_rows=_positive(out, "row_group_rows", "output", _default(OutputSpec, "row_group_rows")),
        compression=_get(out, "compression", str, "output", default=_default(OutputSpec, "compression")),
    )

    mod = _section(raw, "model", required=True)
    _check_keys(mod, [f.name for f in dataclasses.fields(ModelSpec)], "model")
    model_spec = ModelSpec(
        target=_get(mod, "target", str, "model", required=True),
        engine=_get(mod, "engine", dict, "model", default=_default(ModelSpec, "engine")),
    )
    for reserved in ("model", "speculative_config"):
        if reserved in model_spec.engine:
            where = "model.target" if reserved == "model" else "speculative"
            raise SpecError(f"model.engine.{reserved}", f"set this with `{where}` instead")

    speculative = raw.get("speculative")
    if speculative is not None and not isinstance(speculative, dict):
        raise SpecError("speculative", f"expected a mapping or null, got {_kind(speculative)}")
    if speculative is not None:
        speculative = dict(speculative)
        if not speculative.get("method") and not speculative.get("model"):
            raise SpecError("speculative.method",
                            "give a method (draft_model, ngram, eagle, ...) or a draft model")
        if speculative.get("model") and not speculative.get("method"):
            # The seed's shorthand: a draft model plus num_speculative_tokens.
            speculative["method"] = "draft_model"

    sampling = _section(raw, "sampling", required=False)
    exe = _section(raw, "execution", required=False)
    _check_keys(exe, [f.name for f in dataclasses.fields(ExecutionSpec)], "execution")
    execution = ExecutionSpec(
        max_in_flight=_positive(exe, "max_in_flight", "execution", _default(ExecutionSpec, "max_in_flight")),
        read_batch_rows=_positive(exe, "read_batch_rows", "execution",
                                  _default(ExecutionSpec, "read_batch_rows")),
        progress_interval_s=float(_get(exe, "progress_interval_s", (int, float), "execution",
                                       default=_default(ExecutionSpec, "progress_interval_s"))),
        grace_s=_seconds(exe, "grace_s", "execution", _default(ExecutionSpec, "grace_s"), allow_zero=True),
        lease_s=_seconds(exe, "lease_s", "execution", _default(ExecutionSpec, "lease_s"),
                         allow_zero=False),
    )

    ex = _section(raw, "executor", required=False)
    _check_keys(ex, [f.name for f in dataclasses.fields(ExecutorSpec)], "executor")
    kind = _get(ex, "kind", str, "executor", default=_default(ExecutorSpec, "kind"))
    if kind not in EXECUTOR_KINDS:
        raise SpecError("executor.kind", f"expected one of {', '.join(EXECUTOR_KINDS)}, got {kind!r}")
    resources = _get(ex, "resources_per_replica", dict, "executor",
                     default=_default(ExecutorSpec, "resources_per_replica"))
    for key, value in resources.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value < 0:
            raise SpecError(f"executor.resources_per_replica.{key}",
                            f"expected a number of {key} (0 or more), got {value!r}")
    executor = ExecutorSpec(
        kind=kind,
        replicas=_positive(ex, "replicas", "executor", _default(ExecutorSpec, "replicas")),
        resources_per_replica=dict(resources),
        ray_address=_get(ex, "ray_address", str, "executor"),
        max_shard_attempts=_positive(ex, "max_shard_attempts", "executor",
                                     _default(ExecutorSpec, "max_shard_attempts")),
    )

    return JobSpec(
        name=name,
        input=input_spec,
        output=output_spec,
        model=model_spec,
        speculative=speculative,
        sampling=dict(sampling),
        execution=execution,
        raw=raw,
        executor=executor,
    )




def _section(raw: dict, key: str, required: bool) -> dict:
    value = raw.get(key)
    if value is None:
        if required:
            raise SpecError(key, "missing required section")
        return {}
    if not isinstance(value, dict):
        raise SpecError(key, f"expected a mapping, got {_kind(value)}")
    return value




def _check_keys(section: dict, allowed, where: str) -> None:
    allowed = tuple(allowed)
    for key in section:
        if key not in allowed:
            raise SpecError(_join(where, key),
                            f"unknown key{_suggest(str(key), allowed)}; allowed here: "
                            f"{', '.join(allowed)}")




def _get(section: dict, key: str, types, where: str, required: bool = False, default=None):
    value = section.get(key)
    if value is None:
        if required:
            raise SpecError(_join(where, key), "missing required key")
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SpecError(_join(where, key), f"expected {_type_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise SpecError(_join(where, key), f"expected {_type_names(types)}, got {_kind(value)}")
    return value




def _positive(section: dict, key: str, where: str, default: int) -> int:
    value = _get(section, key, int, where, default=default)
    if value <= 0:
        raise SpecError(_join(where, key), f"expected a positive integer, got {value}")
    return value




def _seconds(section: dict, key: str, where: str, default: float, allow_zero: bool) -> float:
    value = float(_get(section, key, (int, float), where, default=default))
    if not value < float("inf") or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise SpecError(_join(where, key), f"expected a number of seconds, {bound}, got {value:g}")
    return value




def check_known_keys(values: dict, known, where: str) -> None:
    """Raise a SpecError naming the first key of ``values`` not in ``known``, with a suggestion."""
    known = tuple(known)
    for key in values:
        if key not in known:
            raise SpecError(_join(where, key), f"unknown key{_suggest(str(key), known)}")




def _suggest(key: str, choices) -> str:
    close = difflib.get_close_matches(key, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""




def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)




def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)




def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(_kind(t()) if t is not type(None) else "null" for t in types)


def _default(cls, name: str) -> Any:
    """A field's default as its dataclass declares it (a fresh copy for mutable ones): the
    defaults live on the dataclasses in spec/model.py, nowhere else."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
