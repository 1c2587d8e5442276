"""What we ask of vLLM without starting an engine: spec keys checked against its own config
classes, the context length, sampling parameters, and the CPU build's refusals (its version is
``vllm_info.py``'s)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from batchspec.engine.heads import check_head_with_lora, check_speculative_model
from batchspec.engine.images import check_images, check_multimodal_drafter
from batchspec.engine.lora import check_lora
from batchspec.engine.reasoning import check_reasoning

# still a name here: the executors and tune's auto record look it up as checks.vllm_version when they
# call it, which is also where the tests' fake engine replaces it
from batchspec.engine.vllm_info import vllm_version  # noqa: F401
from batchspec.errors import SpecError, quoted
from batchspec.io.input_formats import input_format
from batchspec.spec.checkpoints import missing_path
from batchspec.spec.fields import check_known_keys
from batchspec.spec.methods import method
from batchspec.spec.model import JobSpec
from batchspec.tasks import task_for


def _bad_value_errors() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a bad value (VLLMClientError is not a ValueError)."""
    from vllm.exceptions import VLLMClientError

    return (TypeError, ValueError, VLLMClientError)


#: Why batchspec refuses random sampling with speculative decoding on vLLM's CPU build when its
#: vLLM plugin (batchspec.engine.cpu_plugin, which fixes it there) is not active.
CPU_SAMPLING_REFUSAL = (
    "temperature > 0 with speculative decoding is refused on vLLM's CPU build where batchspec's "
    "vLLM plugin is not active (turned off by BATCHSPEC_DISABLE_VLLM_PLUGIN or VLLM_PLUGINS, its "
    "entry point not installed, or a vLLM version it was not checked against): that build's "
    "rejection sampler returns corrupt tokens for sampled requests and for greedy requests batched "
    "with them; use temperature 0, or turn speculative decoding off"
)


def refuses_random_sampling(spec: JobSpec) -> bool:
    """True where vLLM's speculative random sampling is known to be broken: its CPU build, unless
    batchspec's vLLM plugin fixes it in the engines this process starts."""
    if spec.speculative is None:
        return False
    from vllm.platforms import current_platform

    from batchspec.engine import cpu_plugin

    return current_platform.is_cpu() and not cpu_plugin.active()


def _seeded_chunks_crash(spec: JobSpec) -> bool:
    """True where a seeded request split by chunked prefill would kill the engine: vLLM's CPU
    build without batchspec's plugin, for a job that can send a seed."""
    if "seed" not in spec.sampling and "seed" not in spec.input.sampling_columns:
        return False
    from vllm.platforms import current_platform

    from batchspec.engine import cpu_plugin

    return current_platform.is_cpu() and not cpu_plugin.active()


# ---------------------------------------------------------------------------- value types

#: The range of a 64-bit signed integer: what vLLM's integer fields (``seed`` above all: torch's
#: generator takes nothing wider) can hold.
INT64 = (-(1 << 63), (1 << 63) - 1)


class ValueTypeError(TypeError, ValueError):
    """A sampling value of the wrong type (the message names the field and what it wants)."""


@functools.cache
def _sampling_types() -> dict[str, Any]:
    from vllm import SamplingParams

    return typing.get_type_hints(SamplingParams)


def sampling_value(key: str, value: Any) -> Any:
    """``value`` as SamplingParams' field ``key`` takes it, or :class:`ValueTypeError` naming
    the field and the type it wants. Checked against vLLM's own annotations before vLLM sees the
    value: some wrong types pass ``SamplingParams`` and then kill the engine (``seed: "7"``,
    ``seed: 1.5``, ``stop: [["x"]]``).

    An integer field takes an integer (never a bool) within 64 bits, or a number with no
    fractional part: a JSON ``7.0`` is an integer as JSON Schema reads it, and pandas writes an
    integer column with a missing value as float64. A float field takes a finite number; a
    string field a string; a list field a list whose every item is checked. Types batchspec has
    no rule for (vLLM's own parameter classes) pass as they are, for vLLM to judge."""
    hint = _sampling_types().get(key)
    if hint is None:
        return value
    try:
        return _coerce(value, hint)
    except _Mismatch:
        raise ValueTypeError(
            f"{key}: expected {_describe(hint)}, got {quoted(value)} ({type(value).__name__})"
        ) from None


class _Mismatch(Exception):
    pass


def _coerce(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option)
            except _Mismatch:
                continue
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not INT64[0] <= value <= INT64[1]:
            raise _Mismatch
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _Mismatch
        return value
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin in (list, tuple, set, frozenset):
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, list | tuple):
            raise _Mismatch
        item = args[0] if args else Any
        return [_coerce(v, item) for v in value] if item is not Any else list(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch
        return dict(value)
    return value


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin in (list, tuple, set, frozenset):
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "a list"
    return {
        bool: "true or false",
        int: "an integer (64-bit)",
        float: "a finite number",
        str: "a string",
        dict: "a mapping",
    }.get(origin or hint, getattr(hint, "__name__", str(hint)))


# ---------------------------------------------------------------------------- chat template arguments

#: ``sampling.chat_template_kwargs`` (and its per-row column): not a SamplingParams field, but the
#: keyword arguments of the chat template that renders a row's messages (vLLM's server takes the
#: same field).
TEMPLATE_KWARGS = "chat_template_kwargs"

#: ``apply_chat_template``'s own arguments: what batchspec sets, never a template variable.
_TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
#: At most this many arguments, each a JSON scalar (a string of at most MAX_TEMPLATE_STRING
#: characters) or a flat list of at most 64 of them: a template variable is a switch or a word
#: (``enable_thinking``, ``reasoning_effort``), never a payload.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_STRING = 4096


def template_kwargs(value: Any) -> dict[str, Any]:
    """A ``chat_template_kwargs`` value (a mapping, JSON text of one, or a struct cell) as the
    keyword arguments to render with; ValueError naming what is wrong. A null field of a struct
    cell is left out (the template's own default applies)."""
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_KWARGS * (MAX_TEMPLATE_STRING + 64):
            raise ValueError(f"{TEMPLATE_KWARGS}: {len(value)} characters of JSON is too long")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{TEMPLATE_KWARGS}: not a JSON object: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{TEMPLATE_KWARGS}: expected a mapping, got {quoted(value)} ({type(value).__name__})"
        )
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"{TEMPLATE_KWARGS}: {len(value)} arguments; at most {MAX_TEMPLATE_KWARGS}")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{TEMPLATE_KWARGS}: {quoted(key)} is not a template variable name")
        if key in _TEMPLATE_RESERVED:
            raise ValueError(f"{TEMPLATE_KWARGS}.{key}: set by batchspec, not by the job")
        if item is None:
            continue
        items = item if isinstance(item, list | tuple) else [item]
        if isinstance(item, list | tuple) and len(item) > 64:
            raise ValueError(f"{TEMPLATE_KWARGS}.{key}: a list of {len(item)}; at most 64")
        for one in items:
            if not isinstance(one, str | int | float | bool) or (
                isinstance(one, float) and not math.isfinite(one)
            ):
                raise ValueError(
                    f"{TEMPLATE_KWARGS}.{key}: expected a string, number or true/false "
                    f"(or a list of them), got {quoted(one)} ({type(one).__name__})"
                )
            if isinstance(one, str) and len(one) > MAX_TEMPLATE_STRING:
                raise ValueError(
                    f"{TEMPLATE_KWARGS}.{key}: {len(one)} characters; at most {MAX_TEMPLATE_STRING}"
                )
        out[key] = list(item) if isinstance(item, list | tuple) else item
    return out


def row_template_kwargs(base: dict[str, Any], row) -> dict[str, Any]:
    """The chat template's variables for ``row`` (a :class:`batchspec.io.rows.Row`): the job's
    (``base``, checked), updated by the row's own ``chat_template_kwargs``; ValueError where the
    row's are refused, or where there are any and its prompt is text (no chat template renders
    it: an OpenAI Batch ``/v1/completions`` line of a job with ``chat_template_kwargs``)."""
    own = row.overrides.get(TEMPLATE_KWARGS)
    if row.messages is None:
        if own is not None or base:  # the job's or the row's: never dropped without a word
            raise ValueError(f"{TEMPLATE_KWARGS}: a text prompt is not rendered with a chat template")
        return base
    if own is None:
        return base
    return {**base, **template_kwargs(own)}


def check_speculative_method(speculative: dict, key: str = "speculative.method") -> None:
    """Refuse a method this installation cannot run before vLLM would fail on it mid-start: one
    whose package (:class:`batchspec.spec.methods.Package`; ``suffix``'s) is not installed
    (docs/speculation.md says why batchspec's set-up does not build it)."""
    import importlib.util

    known = method(speculative.get("method"))
    package = known.package if known is not None else None
    if package is not None and importlib.util.find_spec(package.module) is None:
        raise SpecError(
            key,
            f"method: {known.name} needs the {package.name} package ({package.what}), which "
            f"is not installed here: pip install {package.name} ({package.build}), or choose "
            f"{package.instead}",
        )


def check_vllm_keys(spec: JobSpec) -> None:
    """Check ``model.engine``, ``speculative`` and ``sampling`` keys against vLLM's own config
    classes, and build the job's SamplingParams once, so a typo exits 2 before any model loads;
    a target or speculative model given as a path with nothing there is refused too."""
    from vllm import SamplingParams
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    # a path with nothing there: vLLM would try it as a model id, after its start-up (tune's
    # candidates are measured as skipped instead)
    drafter = (spec.speculative or {}).get("model")
    for key, model in (("model.target", spec.model.target), ("speculative.model", drafter)):
        missing = missing_path(model)
        if missing is not None:
            raise SpecError(key, missing)
    engine_keys = {f.name for f in dataclasses.fields(EngineArgs)}
    check_known_keys(spec.model.engine, engine_keys, "model.engine")
    if spec.speculative is not None:
        spec_keys = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        check_known_keys(spec.speculative, spec_keys, "speculative")
        check_speculative_method(spec.speculative)
        overrides = spec.model.engine.get("hf_overrides")
        check_multimodal_drafter(spec.model.target, spec.speculative.get("method"), "speculative", overrides)
        check_speculative_model(spec.model.target, spec.speculative)
        check_head_with_lora(spec.model.lora is not None, spec.speculative.get("method"))
    check_known_keys(spec.sampling, (*SamplingParams.__struct_fields__, TEMPLATE_KWARGS), "sampling")
    sampling = dict(spec.sampling)
    constraint = sampling.pop("structured_outputs", None)
    if TEMPLATE_KWARGS in sampling:
        try:
            template_kwargs(sampling.pop(TEMPLATE_KWARGS))
        except ValueError as exc:
            key, _, why = str(exc).partition(": ")
            raise SpecError(f"sampling.{key}", why) from exc
    for key, value in sampling.items():
        try:
            sampling[key] = sampling_value(key, value)
        except ValueTypeError as exc:
            raise SpecError(f"sampling.{key}", str(exc).removeprefix(f"{key}: ")) from exc
    _check_counts(sampling, spec)
    try:
        params = SamplingParams(**sampling)
    except (*_bad_value_errors(), AssertionError) as exc:
        raise SpecError("sampling", str(exc) or type(exc).__name__) from exc
    if constraint is not None:
        check_constraint(constraint, "sampling.structured_outputs")
    if params.temperature > 0 and refuses_random_sampling(spec):
        raise SpecError(
            "sampling.temperature", f"{CPU_SAMPLING_REFUSAL} (SamplingParams' default temperature is 1.0)"
        )
    check_lora(spec)
    check_reasoning(spec)
    check_pooling(spec)
    check_images(spec)


def check_constraint(constraint, key: str) -> dict:
    """A structured-outputs constraint normalised and compiled as vLLM would, or SpecError
    naming ``key`` with the reason."""
    from batchspec.engine import structured

    try:
        normal = structured.normalise(constraint)
        structured.check_with_vllm(normal)
    except structured.ConstraintError as exc:
        raise SpecError(key, str(exc)) from exc
    return normal


#: Sampling fields that count something: what each must be.
_COUNTS = {
    "n": "a positive integer",
    "logprobs": "a non-negative integer (or -1: every token)",
    "prompt_logprobs": "a non-negative integer (or -1: every token)",
}


def count_error(key: str, value, max_logprobs: int = 20, max_n: int | None = None) -> str | None:
    """Why a value of ``n``, ``logprobs`` or ``prompt_logprobs`` is refused, or None: vLLM
    would take a string or a float here and fail later, inside the engine; ``n`` above the job's
    ``execution.max_n`` is refused too."""
    if key not in _COUNTS or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "n" else -1):
        return f"expected {_COUNTS[key]}, got {value!r}"
    if key == "n" and max_n is not None and value > max_n:
        return f"{value} samples is more than execution.max_n ({max_n}) allows"
    if key != "n" and max_logprobs >= 0 and value > max_logprobs:
        return f"{value} is more than the engine returns (model.engine.max_logprobs: {max_logprobs})"
    return None


def _check_counts(sampling: dict, spec: JobSpec) -> None:
    limit = spec.model.engine.get("max_logprobs", 20)
    for key in _COUNTS:
        why = count_error(key, sampling.get(key), limit, spec.execution.max_n)
        if why is not None:
            raise SpecError(f"sampling.{key}", why)


def check_row(
    base: dict | None, overrides: dict, max_logprobs: int, max_n: int | None = None
) -> tuple[dict, dict | None]:
    """A row's own sampling values, checked before vLLM sees them, and the row's constraint:
    each value's type (:func:`sampling_value`: the checked value is returned, an integral float
    as an int), the counts, a constraint parsed and compiled as vLLM's ``auto`` backend would
    (once per distinct value). ValueError or TypeError naming the field when one is refused."""
    from batchspec.engine import structured

    plain = {}
    for key, value in overrides.items():
        if key in structured.COLUMN_KEYS:
            continue
        if key == TEMPLATE_KWARGS:
            template_kwargs(value)
            continue
        plain[key] = value = sampling_value(key, value)
        why = count_error(key, value, max_logprobs, max_n)
        if why is not None:
            raise ValueError(f"{key}: {why}")
    constraint = structured.from_row(base, overrides)
    if constraint is not None and constraint is not base:
        _compile(json.dumps(constraint, sort_keys=True))
    return plain, constraint


@functools.lru_cache(maxsize=512)
def _compile(constraint_json: str) -> None:
    from batchspec.engine import structured

    structured.check_with_vllm(json.loads(constraint_json))


def override_sources(spec: JobSpec) -> tuple[str, dict[str, str]]:
    """Where a row's own sampling values come from, for :func:`override_error`: its columns
    (``input.sampling_columns``), or an OpenAI Batch line's body fields."""
    return input_format(spec.input.format).override_sources(spec)


def override_error(overrides: dict, sources: tuple[str, dict[str, str]], exc: Exception) -> str:
    """The error of a row whose own sampling values are refused, naming where each came from
    (:func:`override_sources`: the columns, or an OpenAI Batch line's body fields)."""
    noun, names = sources
    given = ", ".join(f"{names.get(k, k)!r} ({k}) = {quoted(v)}" for k, v in overrides.items())
    return f"invalid per-row sampling override: {exc} ({noun}: {given})"


def max_model_len(spec: JobSpec) -> int:
    """The context length vLLM would use for this job: its own model config, built from the
    spec's engine arguments without loading weights (rope scaling, sliding windows and an
    explicit ``max_model_len`` all as vLLM resolves them)."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        config = EngineArgs(model=spec.model.target, **spec.model.engine).create_model_config()
    except (TypeError, ValueError) as exc:
        raise SpecError("model", f"vLLM refused the model configuration: {exc}") from exc
    return int(config.max_model_len)


def sampling_temperature(params: dict) -> float:
    """The temperature vLLM samples with under these SamplingParams fields (raises on bad ones)."""
    from vllm import SamplingParams

    return SamplingParams(**params).temperature


def check_pooling(spec: JobSpec) -> None:
    """``pooling`` against vLLM's ``PoolingParams`` (its keys, the ones this task takes, their
    values), so that a typo exits 2 naming the key before any weights load."""
    from vllm import PoolingParams

    task = task_for(spec.task, spec.cross_encoder)
    if task.pooling_task is None:
        return
    allowed = PoolingParams().valid_parameters[task.pooling_task]
    for key, value in spec.pooling.items():
        if key not in allowed:
            known = PoolingParams().all_parameters
            why = (
                f"not a parameter of task {spec.task} "
                f"(vLLM's PoolingParams takes {', '.join(allowed)} for it)"
                if key in known
                else f"unknown key; vLLM's PoolingParams takes {', '.join(allowed)} for task {spec.task}"
            )
            raise SpecError(f"pooling.{key}", why)
        if key == "use_activation" and not isinstance(value, bool):
            raise SpecError(f"pooling.{key}", f"expected true or false, got {value!r}")
