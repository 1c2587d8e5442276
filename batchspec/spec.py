"""The job spec: load YAML, expand ``${VAR}``, apply ``--set``, validate, explain errors.

Every error is a :class:`~batchspec.errors.SpecError` naming the dotted key at fault. Keys that
vLLM owns (``model.engine``, ``speculative``, ``sampling``) keep vLLM's own names and are checked
against vLLM's own config classes by :mod:`batchspec.engine`, so users learn one vocabulary.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from batchspec.errors import SpecError
from batchspec.redact import REDACTED, public_spec
from batchspec.redact import secret_values as _secret_values

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

#: A YAML document (job spec or ``--set`` value) may hold at most this many nodes, counted as if
#: every alias were a copy of what it names: an alias bomb is refused before it is built.
MAX_YAML_NODES = 10_000
#: ... and use at most this many aliases (``*name``, merges ``<<: *name`` included).
MAX_YAML_ALIASES = 100

__all__ = ["REDACTED", "JobSpec", "load_spec", "apply_override", "build_spec", "redact",
           "check_known_keys", "MAX_YAML_NODES", "MAX_YAML_ALIASES"]


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
    #: An input path or glob that matches no file is fine: the run exits 0 with a summary
    #: (for scheduled jobs whose input may be empty some days). False: it is bad input data.
    allow_empty: bool = False

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
    #: Seconds a run stopped by SIGTERM may spend finishing its in-flight requests (and
    #: committing the shards they complete) before it aborts them; 0 aborts at once.
    grace_s: float = 30.0
    #: Seconds after which a shard lease that was not renewed counts as abandoned and another
    #: process may take the shard over.
    lease_s: float = 120.0


#: Where a job's shards run: ``local`` (this process's one engine) or ``ray`` (replicas).
EXECUTOR_KINDS = ("local", "ray")


@dataclass(frozen=True)
class ExecutorSpec:
    """Where the shards run (``executor:``); never part of the output's fingerprint: a job run
    locally and on Ray writes the same files, and either may resume the other."""

    #: ``local``: one engine in this process; ``ray``: ``replicas`` Ray actors, one engine each.
    kind: str = "local"
    #: Ray actors, each holding one vLLM engine (tensor/pipeline parallel stay engine args).
    replicas: int = 1
    #: Ray resources each replica reserves: ``CPU``, ``GPU``, or custom resource names.
    resources_per_replica: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    #: The Ray cluster to join (``ray://host:10001``, ``auto``); unset starts a local one.
    ray_address: str | None = None
    #: Tries a shard gets when the replica running it dies, before it is reported failed.
    max_shard_attempts: int = 3


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
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)

    def public(self) -> dict[str, Any]:
        """The resolved spec as it may be persisted or logged (:func:`batchspec.redact.public_spec`):
        no storage options, credentials, URL userinfo or query strings."""
        return public_spec(self.raw)

    def secret_values(self) -> set[str]:
        """The values :meth:`public` hides, for :func:`batchspec.redact.scrub_text`."""
        return _secret_values(self.raw)

    def redacted(self) -> dict[str, Any]:
        """Same as :meth:`public` (the older name)."""
        return self.public()


# --------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
              environ: Mapping[str, str] | None = None) -> JobSpec:
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
        raise SpecError(None, f"{path}: the job spec must be a mapping of keys, not {_kind(raw)}")
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
        raise SpecError(None, f"--set {item!r}: expected KEY=VALUE with a dotted key, "
                              "e.g. --set sampling.max_tokens=32")
    parts = key.split(".")
    if value.strip():
        parsed = load_yaml(value, f"--set {key}", os.environ if environ is None else environ,
                           key_path=key)
    else:
        parsed = ""
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(".".join(parts[: i + 1]),
                            f"--set {key}: this key holds {_kind(child)}, not a mapping")
        node = child
    node[parts[-1]] = parsed


def redact(value: Any, inside_storage: bool = False) -> Any:
    """The persisted view of a spec mapping: see :func:`batchspec.redact.public_spec`.

    Kept for older callers; ``inside_storage`` masks every leaf, as under ``storage_options``."""
    if inside_storage:
        return public_spec({"storage_options": value})["storage_options"]
    if isinstance(value, dict):
        return public_spec(value)
    return public_spec({"value": value})["value"]


# --------------------------------------------------------------------------- YAML


class _Unset:
    """Placeholder for a value that names an unset ``${VAR}``: an error only if it survives
    the ``--set`` overrides."""

    __slots__ = ("key", "name")

    def __init__(self, key: str, name: str):
        self.key, self.name = key, name

    def error(self) -> SpecError:
        return SpecError(self.key or None, f"${{{self.name}}} is not set in the environment "
                                           f"(use ${{{self.name}:-default}} for a default)")


class _Refused(Exception):
    """A YAML document over the alias or size limits (turned into a SpecError)."""


_UNSET_TAG = "tag:batchspec,2026:unset-variable"
_STR_TAG = "tag:yaml.org,2002:str"
#: What an expanded plain scalar may become: YAML's null, bool, int and float. A timestamp stays
#: a string: dates are what schedulers template most, and they name paths and runs.
_TYPED_TAGS = frozenset({"tag:yaml.org,2002:null", "tag:yaml.org,2002:bool",
                         "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})


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
                raise _Refused(f"more than {MAX_YAML_ALIASES} YAML aliases (*name); write "
                               "the repeated values out")
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
            raise _Refused(f"it expands to {size:,} nodes when its aliases are copied, more "
                           f"than {MAX_YAML_NODES:,} (an alias bomb?)")
        return node


_SpecLoader.add_constructor(_UNSET_TAG,
                            lambda loader, node: _Unset(*node.value.split("\0", 1)))


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
        raise SpecError(key_path or None, f"{source}: refused: the YAML is nested too deeply") \
            from None
    except yaml.YAMLError as exc:
        what = "value is not valid YAML" if key_path else "not valid YAML"
        raise SpecError(key_path or None, f"{source}: {what}: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()
    return _unshare(data)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without PyYAML's quote of the line: it may hold a credential."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem is None:
        return type(exc).__name__
    where = ""
    if exc.problem_mark is not None:
        where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
    context = f" ({exc.context})" if exc.context else ""
    return f"{exc.problem}{where}{context}"


def _unshare(value: Any) -> Any:
    """A copy in which no two places share a mapping or list (an anchor used twice gives two),
    so that ``--set`` on one key never changes another. Bounded by MAX_YAML_NODES."""
    if isinstance(value, dict):
        return {k: _unshare(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshare(v) for v in value]
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
    allow_empty = _get(inp, "allow_empty", bool, "input", default=False)
    input_spec = InputSpec(
        paths=tuple(paths),
        prompt_column=prompt_column,
        messages_column=messages_column,
        id_column=_get(inp, "id_column", str, "input"),
        sampling_columns=dict(sampling_columns),
        storage_options=_get(inp, "storage_options", dict, "input", default={}),
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
        grace_s=_seconds(exe, "grace_s", "execution", 30.0, allow_zero=True),
        lease_s=_seconds(exe, "lease_s", "execution", 120.0, allow_zero=False),
    )

    ex = _section(raw, "executor", required=False)
    _check_keys(ex, [f.name for f in dataclasses.fields(ExecutorSpec)], "executor")
    kind = _get(ex, "kind", str, "executor", default="local")
    if kind not in EXECUTOR_KINDS:
        raise SpecError("executor.kind", f"expected one of {', '.join(EXECUTOR_KINDS)}, got {kind!r}")
    resources = _get(ex, "resources_per_replica", dict, "executor", default={"CPU": 1})
    for key, value in resources.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value < 0:
            raise SpecError(f"executor.resources_per_replica.{key}",
                            f"expected a number of {key} (0 or more), got {value!r}")
    executor = ExecutorSpec(
        kind=kind,
        replicas=_positive(ex, "replicas", "executor", 1),
        resources_per_replica=dict(resources),
        ray_address=_get(ex, "ray_address", str, "executor"),
        max_shard_attempts=_positive(ex, "max_shard_attempts", "executor", 3),
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
