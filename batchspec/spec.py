"""The job spec: load YAML, expand ``${VAR}``, apply ``--set``, validate, explain errors.

Every error is a :class:`~batchspec.errors.SpecError` naming the dotted key at fault. Keys that
vLLM owns (``model.engine``, ``speculative``, ``sampling``) keep vLLM's own names and are checked
against vLLM's own config classes by :mod:`batchspec.engine`, so users learn one vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batchspec.errors import SpecError

#: SamplingParams fields a row may override from its own column (``input.sampling_columns``).
ROW_OVERRIDABLE = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
)

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|key|sas|signature|connection", re.I)
REDACTED = "***"


@dataclass(frozen=True)
class InputSpec:
    """Where the prompts are and how to read them."""

    #: fsspec URLs of the input shards: paths or globs (local, s3://, gs://, az://, memory://).
    paths: tuple[str, ...]
    #: Column holding the text prompt (exclusive with ``messages_column``).
    prompt_column: str | None = None
    #: Column holding chat messages (list of {role, content}), rendered by the chat template.
    messages_column: str | None = None
    #: Column holding a row's id; default id is ``<shard name>/<row index>``.
    id_column: str | None = None
    #: SamplingParams field -> input column that overrides it per row (null keeps the job value).
    sampling_columns: dict[str, str] = field(default_factory=dict)
    #: Handed to fsspec as is (endpoint, credentials, ...).
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: ``fail``: an unreadable shard exits 3; ``skip``: it is recorded in the run summary.
    on_bad_shard: str = "fail"

    @property
    def text_column(self) -> str:
        """The column the prompt comes from, whichever kind it is."""
        return self.prompt_column or self.messages_column  # type: ignore[return-value]


@dataclass(frozen=True)
class OutputSpec:
    """Where results go."""

    #: Directory URL; may be on another filesystem than the input.
    path: str
    #: Input columns copied to the output; None keeps all but the prompt/messages column.
    keep_columns: tuple[str, ...] | None = None
    #: Handed to fsspec as is.
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: Rows per Parquet row group; results are written as they complete, in groups this size.
    row_group_rows: int = 1024
    #: Parquet compression codec.
    compression: str = "zstd"


@dataclass(frozen=True)
class ModelSpec:
    """The target model and how vLLM runs it."""

    #: Local path or model id, as ``vllm.LLM(model=...)`` takes it.
    target: str
    #: ``vllm.LLM`` keyword arguments (max_model_len, dtype, tensor_parallel_size, ...).
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecutionSpec:
    """How the runner feeds the engine."""

    #: Requests handed to the engine at once; refilled as requests finish.
    max_in_flight: int = 512
    #: Rows per record batch read from a shard.
    read_batch_rows: int = 1024
    #: Seconds between progress log lines when not at a terminal.
    progress_interval_s: float = 30.0


@dataclass(frozen=True)
class JobSpec:
    """A whole job, validated. ``raw`` is the resolved YAML mapping it was built from."""

    name: str
    input: InputSpec
    output: OutputSpec
    model: ModelSpec
    #: vLLM ``speculative_config``; None turns speculative decoding off.
    speculative: dict[str, Any] | None
    #: ``vllm.SamplingParams`` keyword arguments.
    sampling: dict[str, Any]
    execution: ExecutionSpec
    raw: dict[str, Any] = field(repr=False, compare=False)

    def redacted(self) -> dict[str, Any]:
        """The resolved spec with credentials in every ``storage_options`` removed."""
        return redact(self.raw)


# --------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
              environ: dict[str, str] | None = None) -> JobSpec:
    """Read a YAML job spec, apply ``--set`` overrides, expand ``${VAR}`` and validate it."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(None, f"cannot read job spec {path}: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(None, f"{path} is not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(None, f"{path}: the job spec must be a mapping of keys, not {_kind(raw)}")
    for item in overrides:
        apply_override(raw, item)
    raw = expand_vars(raw, os.environ if environ is None else environ)
    return build_spec(raw)


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``--set a.b=value``; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError(None, f"--set {item!r}: expected KEY=VALUE with a dotted key, "
                              "e.g. --set sampling.max_tokens=32")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(key, f"--set value {value!r} is not valid YAML: {exc}") from exc
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(".".join(parts[: i + 1]),
                            f"--set {key}: this key holds {_kind(child)}, not a mapping")
        node = child
    node[parts[-1]] = parsed


def expand_vars(value: Any, environ: dict[str, str] | os._Environ, key: str = "") -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in every string of the spec."""
    if isinstance(value, dict):
        return {k: expand_vars(v, environ, _join(key, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_vars(v, environ, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise SpecError(key or None, f"${{{name}}} is not set in the environment "
                                     f"(use ${{{name}:-default}} for a default)")

    return _VAR.sub(sub, value)


def redact(value: Any, inside_storage: bool = False) -> Any:
    """A copy with credential-looking values in ``storage_options`` replaced by ``***``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if inside_storage and _SECRET_KEY.search(str(k)) and not isinstance(v, dict):
                out[k] = REDACTED
            else:
                out[k] = redact(v, inside_storage or k == "storage_options")
        return out
    if isinstance(value, list):
        return [redact(v, inside_storage) for v in value]
    return copy.deepcopy(value)


# --------------------------------------------------------------------------- validation

_TOP_KEYS = ("name", "input", "output", "model", "speculative", "sampling", "execution")


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
    sampling_columns = _get(inp, "sampling_columns", dict, "input", default={})
    for k, v in sampling_columns.items():
        if k not in ROW_OVERRIDABLE:
            raise SpecError(f"input.sampling_columns.{k}",
                            f"not a per-row SamplingParams field{_suggest(k, ROW_OVERRIDABLE)}; "
                            f"one of: {', '.join(ROW_OVERRIDABLE)}")
        if not isinstance(v, str) or not v:
            raise SpecError(f"input.sampling_columns.{k}", "expected the name of an input column")
    on_bad_shard = _get(inp, "on_bad_shard", str, "input", default="fail")
    if on_bad_shard not in ("fail", "skip"):
        raise SpecError("input.on_bad_shard", f"expected 'fail' or 'skip', got {on_bad_shard!r}")
    input_spec = InputSpec(
        paths=tuple(paths),
        prompt_column=prompt_column,
        messages_column=messages_column,
        id_column=_get(inp, "id_column", str, "input"),
        sampling_columns=dict(sampling_columns),
        storage_options=_get(inp, "storage_options", dict, "input", default={}),
        on_bad_shard=on_bad_shard,
    )

    out = _section(raw, "output", required=True)
    _check_keys(out, [f.name for f in dataclasses.fields(OutputSpec)], "output")
    keep = _get(out, "keep_columns", list, "output")
    if keep is not None and not all(isinstance(c, str) and c for c in keep):
        raise SpecError("output.keep_columns", "expected a list of column names")
    output_spec = OutputSpec(
        path=_get(out, "path", str, "output", required=True),
        keep_columns=tuple(keep) if keep is not None else None,
        storage_options=_get(out, "storage_options", dict, "output", default={}),
        row_group_rows=_positive(out, "row_group_rows", "output", 1024),
        compression=_get(out, "compression", str, "output", default="zstd"),
    )

    mod = _section(raw, "model", required=True)
    _check_keys(mod, [f.name for f in dataclasses.fields(ModelSpec)], "model")
    model_spec = ModelSpec(
        target=_get(mod, "target", str, "model", required=True),
        engine=_get(mod, "engine", dict, "model", default={}),
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
        max_in_flight=_positive(exe, "max_in_flight", "execution", 512),
        read_batch_rows=_positive(exe, "read_batch_rows", "execution", 1024),
        progress_interval_s=float(_get(exe, "progress_interval_s", (int, float), "execution",
                                       default=30.0)),
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
