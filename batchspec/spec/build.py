"""Build a :class:`JobSpec` from the parsed YAML: check every key and value, with errors that name
the key (exit 2); defaults and choices come from the dataclasses in spec/model.py (a field typed
with a ``Literal`` offers its values, checked in :meth:`Fields.get`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from batchspec.errors import SpecError, quoted
from batchspec.spec.fields import (
    Fields,
    check_keys,
    check_known_keys,
    get_value,
    kind_of,
    section,
    suggest,
)
from batchspec.spec.model import (
    DEFAULT_JOB_NAME,
    ROW_OVERRIDABLE,
    ExecutionSpec,
    ExecutorSpec,
    InputSpec,
    JobSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
)
from batchspec.spec.speculative import auto_speculation, is_auto, speculative_section
from batchspec.spec.tasks import check_task, pairs_of, task_of

# --------------------------------------------------------------------------- validation


def check_executor(spec: JobSpec, kind: str, key: str) -> None:
    """Exit 2 naming ``key`` (``executor.kind`` or ``--executor``) where executor ``kind``
    cannot run ``spec``: Ray measures no ``speculative: auto`` choice, and reads and commits
    no table."""
    if kind != "ray":
        return
    if spec.speculative_auto is not None:
        raise SpecError(
            "speculative",
            "auto measures its candidates on this process's own engine before the shards run; "
            f"with {'--executor' if key.startswith('--') else 'executor.kind'} ray, run "
            "`batchspec tune` and set the speculative section it writes",
        )
    from batchspec.io.input_formats import input_format
    from batchspec.io.output_formats import output_format

    tables = [
        f"{side}.format {fmt.name}"
        for side, fmt in (
            ("input", input_format(spec.input.format)),
            ("output", output_format(spec.output.format)),
        )
        if fmt.table
    ]
    if tables:
        raise SpecError(
            key,
            f"a table ({', '.join(tables)}) is read and committed by one local executor; "
            "run several workers with --worker-index/--num-workers instead of ray",
        )


_TOP_KEYS = (
    "name",
    "task",
    "input",
    "output",
    "model",
    "speculative",
    "sampling",
    "pooling",
    "execution",
    "executor",
)


def build_spec(raw: dict[str, Any]) -> JobSpec:
    """Validate a resolved spec mapping and build the typed :class:`JobSpec`, section by section
    in the order of :data:`_TOP_KEYS` (the first error found is the one reported)."""
    check_keys(raw, _TOP_KEYS, "")
    task = task_of(raw)
    spec = JobSpec(
        name=get_value(raw, "name", str, "", default=DEFAULT_JOB_NAME),
        input=_input_spec(raw),
        output=_output_spec(raw),
        model=_model_spec(raw),
        speculative=None if is_auto(raw) else speculative_section(raw),
        sampling=dict(section(raw, "sampling", required=False)),
        execution=_execution_spec(raw),
        raw=raw,
        executor=_executor_spec(raw),
        speculative_auto=auto_speculation(raw),
        task=task.name,
        pooling=dict(section(raw, "pooling", required=False)),
    )
    spec = check_task(spec, task)
    check_executor(spec, spec.executor.kind, "executor.kind")
    _check_reasoning(spec)
    if spec.input.lora_column and spec.model.lora is None:
        raise SpecError(
            "input.lora_column",
            "rows can pick a LoRA adapter only from those model.lora.adapters names; model.lora is not set",
        )
    return _parse_json(spec)


def _check_reasoning(spec: JobSpec) -> None:
    """The reasoning keys that need ``model.reasoning_parser``, or a chat prompt."""
    columns = spec.input.sampling_columns
    if spec.model.reasoning_parser is None:
        for key in ("thinking_token_budget",):
            if key in spec.sampling or key in columns:
                where = f"sampling.{key}" if key in spec.sampling else f"input.sampling_columns.{key}"
                raise SpecError(
                    where,
                    "vLLM counts a thinking budget with the model's reasoning parser: "
                    "set model.reasoning_parser (such as qwen3 or deepseek_r1)",
                )
    kwargs = spec.sampling.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise SpecError(
            "sampling.chat_template_kwargs",
            f"expected a mapping of the chat template's keyword arguments, got {type(kwargs).__name__}",
        )
    text = spec.input.prompt_column is not None or spec.input.prompt_template is not None
    if not _self_describing(spec) and text:
        key = (
            "sampling.chat_template_kwargs"
            if kwargs is not None
            else "input.sampling_columns.chat_template_kwargs"
            if "chat_template_kwargs" in columns
            else None
        )
        if key is not None:
            raise SpecError(
                key,
                "a text prompt (input.prompt_column or input.prompt_template) is not rendered "
                "with a chat template; use input.messages_column or input.messages_template "
                "for chat template keyword arguments",
            )


#: The ``input.sampling_columns`` keys whose rows may ask for a JSON schema or a choice.
_ANSWER_COLUMNS = ("structured_outputs", "structured_outputs.json", "structured_outputs.choice")


def _parse_json(spec: JobSpec) -> JobSpec:
    """``output.parse_json``: refused without a constraint an answer's type comes from (a JSON
    schema or a choice, job-wide or per row) and with OpenAI output; with a JSON schema, it
    makes JSON compact (``disable_any_whitespace`` on an ``xgrammar`` backend) unless
    ``model.engine.structured_outputs_config`` says otherwise."""
    if not spec.output.parse_json:
        return spec
    from batchspec.io.output_formats import output_format

    refused = output_format(spec.output.format).no_typed_answer
    if refused is not None:
        raise SpecError("output.parse_json", refused)
    if spec.output.keep_columns is not None and "answer" in spec.output.keep_columns:
        raise SpecError("output.keep_columns", "'answer' clashes with the column output.parse_json writes")
    constraint = spec.sampling.get("structured_outputs")
    if isinstance(constraint, str):
        try:
            constraint = json.loads(constraint)
        except ValueError:
            constraint = None  # refused with its reason when the sampling is checked
    kinds = {k for k, v in constraint.items() if v is not None} if isinstance(constraint, dict) else set()
    per_row = _self_describing(spec) or any(k in spec.input.sampling_columns for k in _ANSWER_COLUMNS)
    if not per_row and not kinds & {"json", "choice"}:
        raise SpecError(
            "output.parse_json",
            "needs a JSON schema (sampling.structured_outputs.json) or a choice to type the "
            "answer column with, or per-row constraints (input.sampling_columns "
            "structured_outputs or structured_outputs.json); "
            + (f"the job's constraint is {', '.join(sorted(kinds))}" if kinds else "there is none"),
        )
    wide_choice = "choice" in kinds and not any(
        k in spec.input.sampling_columns for k in ("structured_outputs", "structured_outputs.json")
    )
    if wide_choice and not _self_describing(spec):
        return spec  # no JSON to make compact
    engine = _compact_json(spec.model.engine)
    if engine is spec.model.engine:
        return spec
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, engine=engine))


def _compact_json(engine: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments with compact JSON (vLLM's ``disable_any_whitespace``, engine-wide,
    which it takes only with the ``xgrammar`` or ``guidance`` backend): ``engine`` itself where
    the job set ``disable_any_whitespace`` (either way) or another backend (``auto`` included)."""
    config = engine.get("structured_outputs_config")
    config = {} if config is None else config
    if not isinstance(config, dict) or "disable_any_whitespace" in config:
        return engine
    backend = config.get("backend")
    if backend not in (None, "xgrammar", "guidance"):
        return engine
    return {
        **engine,
        "structured_outputs_config": {
            **config,
            "backend": backend or "xgrammar",
            "disable_any_whitespace": True,
        },
    }


def _input_spec(raw: dict) -> InputSpec:
    inp = Fields(
        raw,
        "input",
        InputSpec,
        required=True,
        keys=("path", *(f.name for f in dataclasses.fields(InputSpec) if f.name != "paths")),
    )
    input_format = inp.get("format", str)
    fmt = _input_format(input_format)
    table = _input_table(inp, fmt)
    if not fmt.takes_path:
        paths = []
    else:
        paths = inp.get("path", (str, list), required=True)
        paths = [paths] if isinstance(paths, str) else paths
        if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            raise SpecError("input.path", "expected a non-empty URL or glob, or a list of them")
    if fmt.one_root and (len(paths) != 1 or any(c in paths[0] for c in "*?[")):
        raise SpecError(
            "input.path", f"format {fmt.name} reads one table: give its root, one URL without wildcards"
        )
    prompt_column = inp.get("prompt_column", str)
    messages_column = inp.get("messages_column", str)
    prompt_template, messages_template = _templates(inp)
    pair_columns, pair_templates = pairs_of(inp)
    if pair_columns is not None:
        prompt_column = pair_columns[0]  # the first text is read as a prompt; the second beside it
    sources = (prompt_column, messages_column, prompt_template, messages_template, pair_templates)
    if fmt.self_describing:
        for key in (
            "prompt_column",
            "messages_column",
            "prompt_template",
            "messages_template",
            "pair_templates",
            "id_column",
            "lora_column",
            "sampling_columns",
            "image_columns",
        ):
            if inp.get(key, (str, dict, list)):
                raise SpecError(
                    f"input.{key}",
                    "an OpenAI batch file's lines give their own "
                    "prompt or messages, custom_id, model and "
                    "sampling; leave this key out",
                )
    elif sum(v is not None for v in sources) != 1:
        given = [
            k
            for k in ("prompt_column", "messages_column", "prompt_template", "messages_template")
            if inp.values.get(k) is not None
        ]
        raise SpecError(
            f"input.{next((k for k in given if k.endswith('_template')), 'prompt_column')}",
            "give exactly one of input.prompt_column (text), input.messages_column (chat "
            "messages), input.prompt_template and input.messages_template (rendered from columns)"
            + (f"; got {' and '.join(given)}" if len(given) > 1 else ""),
        )
    if not fmt.self_describing and (prompt_template is not None or messages_template is not None):
        # compiled now (exit 2 naming the key and the line); io/templates.py imports jinja2 only
        from batchspec.io.templates import PromptTemplate

        PromptTemplate(prompt_template, messages_template)
    sampling_columns = inp.get("sampling_columns", dict)
    for k, v in sampling_columns.items():
        if k not in ROW_OVERRIDABLE:
            raise SpecError(
                f"input.sampling_columns.{k}",
                f"not a per-row SamplingParams field{suggest(k, ROW_OVERRIDABLE)}; "
                f"one of: {', '.join(ROW_OVERRIDABLE)}",
            )
        if not isinstance(v, str) or not v:
            raise SpecError(f"input.sampling_columns.{k}", "expected the name of an input column")
    on_bad_shard = inp.get("on_bad_shard", str)
    allow_empty = inp.get("allow_empty", bool)
    images = _images(inp)
    return InputSpec(
        paths=tuple(paths),
        format=input_format,
        prompt_column=prompt_column,
        messages_column=messages_column,
        prompt_template=prompt_template,
        messages_template=messages_template,
        id_column=inp.get("id_column", str),
        lora_column=inp.get("lora_column", str),
        sampling_columns=dict(sampling_columns),
        storage_options=inp.get("storage_options", dict),
        on_bad_shard=on_bad_shard,
        allow_empty=allow_empty,
        max_line_bytes=inp.positive("max_line_bytes"),
        pair_columns=pair_columns,
        pair_templates=pair_templates,
        **images,
        **table,
    )


def _names(inp: Fields, key: str) -> tuple[str, ...]:
    """A key that takes one string or a list of them, each non-empty and none twice."""
    value = inp.get(key, (str, list))
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not all(isinstance(v, str) and v.strip() for v in values):
        raise SpecError(f"input.{key}", "expected a non-empty string or a list of them")
    if len(set(values)) != len(values):
        raise SpecError(f"input.{key}", "a value is named twice")
    return tuple(values)


def _images(inp: Fields) -> dict[str, Any]:
    """``input.image_columns``, ``image_roots`` and the image limits (batchspec/io/images.py)."""
    from batchspec.io.images import ImageError, check_readable  # lazy: io/ sits above spec/

    columns, roots = _names(inp, "image_columns"), _names(inp, "image_roots")
    for root in roots:
        if root.lower().startswith("data:"):
            raise SpecError("input.image_roots", f"{root[:16]!r}... is no storage location")
        try:
            check_readable(root)
        except ImageError as exc:
            raise SpecError("input.image_roots", str(exc).replace("image URL", "location", 1)) from exc
    return {
        "image_columns": columns,
        "image_roots": roots,
        "max_image_bytes": inp.positive("max_image_bytes"),
        "max_image_pixels": inp.positive("max_image_pixels"),
    }


def _templates(inp: Fields) -> tuple[str | None, tuple[dict[str, str], ...] | None]:
    """``input.prompt_template`` (text) and ``input.messages_template`` (a list of ``{role,
    content}``, each content a template), their shapes checked (compiled by the caller)."""
    prompt = inp.get("prompt_template", str)
    if prompt is not None and not prompt.strip():
        raise SpecError("input.prompt_template", "expected a Jinja2 template, got an empty string")
    messages = inp.get("messages_template", list)
    if messages is None:
        return prompt, None
    if not messages:
        raise SpecError("input.messages_template", "expected a list of {role, content} templates")
    for i, message in enumerate(messages):
        key = f"input.messages_template[{i}]"
        if not isinstance(message, dict):
            raise SpecError(key, f"expected a mapping {{role, content}}, got {kind_of(message)}")
        check_known_keys(message, ("role", "content"), key)
        for part in ("role", "content"):
            if not isinstance(message.get(part), str) or not message[part].strip():
                got = kind_of(message.get(part))
                raise SpecError(f"{key}.{part}", f"expected a non-empty string, got {got}")
    return prompt, tuple({"role": m["role"], "content": m["content"]} for m in messages)


def _input_format(name: str | None):
    # io/input_formats.py describes each format (imported here, not at the top, as io/ sits
    # above spec/; it imports nothing heavy)
    from batchspec.io.input_formats import input_format

    return input_format(name)


def _self_describing(spec: JobSpec) -> bool:
    """Whether the job's rows name their own requests (an OpenAI Batch request file)."""
    return _input_format(spec.input.format).self_describing


def _input_table(inp: Fields, fmt) -> dict:
    """The table keys of ``input`` (``table``, ``catalog``, ``version``, ``snapshot``,
    ``filter``), each refused where ``input.format`` does not read it."""
    from batchspec.io.input_formats import FORMAT_KEYS

    for key, formats in FORMAT_KEYS.items():
        if inp.values.get(key) not in (None, {}) and fmt.name not in formats:
            raise SpecError(
                f"input.{key}",
                f"read only with input.format {' or '.join(formats)}, not "
                f"{inp.values.get('format') or 'files'}; leave this key out",
            )
    if fmt.library is not None:
        _check_extra(f"input.format {fmt.name}", fmt.library, fmt.name)
    if not fmt.takes_path:
        if inp.values.get("path") is not None:
            raise SpecError(
                "input.path",
                f"format {fmt.name} finds the table through input.catalog: give input.table, not a path",
            )
        _catalog_table(inp, "input")
    values = {
        "table": inp.get("table", str),
        "catalog": dict(inp.get("catalog", dict)),
        "version": _version(inp, "version", fmt),
        "snapshot": _version(inp, "snapshot", fmt),
        "filter": inp.get("filter", str),
    }
    if values["filter"] is not None:
        _check_filter(values["filter"], fmt)
    return values


def _version(fields: Fields, key: str, fmt) -> int | None:
    """A table's pin, 0 to the largest its library takes (``fmt.pin_max``)."""
    value = fields.get(key, int)
    if value is not None and not 0 <= value <= fmt.pin_max:
        raise SpecError(
            f"{fields.name}.{key}", f"expected a {key} number, 0 to {fmt.pin_max}, got {quoted(value)}"
        )
    return value


def _catalog_table(fields: Fields, side: str) -> None:
    """``<side>.table`` (``NAMESPACE.TABLE``) and ``<side>.catalog`` (a mapping), both given."""
    table = fields.get("table", str, required=True)
    if "." not in table.strip(".") or any(not part.strip() for part in table.split(".")):
        raise SpecError(f"{side}.table", f"expected NAMESPACE.TABLE, got {table!r}")
    catalog = fields.get("catalog", dict, required=True)
    if not catalog:
        raise SpecError(
            f"{side}.catalog",
            "expected pyiceberg's catalog properties, e.g. "
            "{type: sql, uri: 'sqlite:///catalog.db', warehouse: ...}",
        )


def _check_extra(what: str, module: str, name: str) -> None:
    """Exit 2 naming ``what`` when ``module``, the library of format ``name``, is not
    installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SpecError(
            what.split(" ")[0], f"{what} needs {module}: install batchspec[{name}] (make setup does)"
        )


def _check_filter(predicate: str, fmt) -> None:
    """``input.filter`` parsed as the table library parses it: exit 2 before anything is read."""
    if not predicate.strip():
        raise SpecError("input.filter", "expected a predicate, got an empty string")
    try:
        fmt.check_filter(predicate)
    except Exception as exc:
        raise SpecError("input.filter", f"not a predicate {fmt.name} reads: {predicate!r}: {exc}") from exc


def _output_spec(raw: dict) -> OutputSpec:
    out = Fields(raw, "output", OutputSpec, required=True)
    keep = out.get("keep_columns", list)
    if keep is not None and not all(isinstance(c, str) and c for c in keep):
        raise SpecError("output.keep_columns", "expected a list of column names")
    output_format = out.get("format", str)
    # what the format asks of the spec (batchspec/io/output_formats.py: imported here, not at
    # the top, as io/ sits above spec/; it imports nothing heavy)
    from batchspec.io.output_formats import output_format as format_named

    fmt = format_named(output_format)
    if fmt.input_format is not None and (raw.get("input") or {}).get("format") != fmt.input_format:
        raise SpecError("output.format", fmt.input_format_why)
    for key in fmt.refused_keys:
        if key in out.values:
            raise SpecError(f"output.{key}", fmt.refused_why)
    from batchspec.io.output_formats import FORMAT_KEYS

    for key, formats in FORMAT_KEYS.items():
        if out.values.get(key) not in (None, {}) and fmt.name not in formats:
            raise SpecError(
                f"output.{key}",
                f"read only with output.format {' or '.join(formats)}, not "
                f"{output_format or 'parquet'}; leave this key out",
            )
    if fmt.library is not None:
        _check_extra(f"output.format {fmt.name}", fmt.library, fmt.name)
    if fmt.catalog:
        _catalog_table(out, "output")
    interval = out.get("commit_interval_s", (int, float))
    if isinstance(interval, bool) or not 0 < interval < float("inf"):
        raise SpecError(
            "output.commit_interval_s", f"expected a number of seconds, more than zero, got {interval!r}"
        )
    return OutputSpec(
        path=out.get("path", str, required=True),
        keep_columns=tuple(keep) if keep is not None else None,
        storage_options=out.get("storage_options", dict),
        row_group_rows=out.positive("row_group_rows"),
        compression=out.get("compression", str),
        format=output_format,
        table=out.get("table", str),
        catalog=dict(out.get("catalog", dict)),
        commit_shards=out.positive("commit_shards"),
        commit_interval_s=float(interval),
        parse_json=out.get("parse_json", bool),
    )


def _model_spec(raw: dict) -> ModelSpec:
    mod = Fields(raw, "model", ModelSpec, required=True)
    model_spec = ModelSpec(
        target=mod.get("target", str, required=True),
        engine=mod.get("engine", dict),
        lora=_lora_spec(mod),
        reasoning_parser=mod.get("reasoning_parser", str) or None,
    )
    for reserved, where in _ENGINE_RESERVED.items():
        if reserved in model_spec.engine:
            raise SpecError(f"model.engine.{reserved}", f"set this with `{where}` instead")
    if model_spec.lora is not None:
        served = model_spec.engine.get("served_model_name") or model_spec.target
        served = {str(n) for n in (served if isinstance(served, list | tuple) else [served])}
        for name in model_spec.lora.adapters:
            if name in served:
                # an OpenAI Batch line naming the base model would run with the adapter
                raise SpecError(
                    f"model.lora.adapters.{name}",
                    "an adapter may not share its name with the model the job serves "
                    "(model.target or model.engine.served_model_name): rows naming "
                    "that model would run with the adapter; rename the adapter",
                )
    return model_spec


#: Engine arguments batchspec sets from other keys of the spec.
_ENGINE_RESERVED = {
    "model": "model.target",
    "speculative_config": "speculative",
    "enable_lora": "model.lora.adapters",
    "max_loras": "model.lora.max_loras",
    "max_lora_rank": "model.lora.max_lora_rank",
    "reasoning_parser": "model.reasoning_parser",
}


def _lora_spec(mod: Fields) -> LoraSpec | None:
    values = mod.get("lora", dict)
    if values is None:
        return None
    lora = Fields({"model.lora": values}, "model.lora", LoraSpec, required=True)
    adapters = lora.get("adapters", dict, required=True)
    if not adapters:
        raise SpecError(
            "model.lora.adapters", "expected at least one adapter: name -> local directory or model id"
        )
    for name, source in adapters.items():
        if not isinstance(name, str) or not name.strip():
            raise SpecError("model.lora.adapters", f"expected adapter names, got {name!r}")
        if not isinstance(source, str) or not source.strip():
            raise SpecError(
                f"model.lora.adapters.{name}",
                f"expected a local directory or a model id, got {kind_of(source)}",
            )
        if "://" in source:
            raise SpecError(
                f"model.lora.adapters.{name}",
                "vLLM loads an adapter from a local directory or a model id, not "
                f"from a URL ({source.split('://', 1)[0]}://): copy it to local disk",
            )
    adapter = lora.get("adapter", str)
    if adapter is not None and adapter not in adapters:
        raise SpecError(
            "model.lora.adapter",
            f"{adapter!r} is not one of model.lora.adapters"
            f"{suggest(adapter, adapters)}: "
            f"{', '.join(adapters)}",
        )
    return LoraSpec(
        adapters=dict(adapters),
        adapter=adapter,
        max_loras=None if lora.values.get("max_loras") is None else lora.positive("max_loras"),
        max_lora_rank=(None if lora.values.get("max_lora_rank") is None else lora.positive("max_lora_rank")),
    )


def _execution_spec(raw: dict) -> ExecutionSpec:
    exe = Fields(raw, "execution", ExecutionSpec, required=False)
    return ExecutionSpec(
        max_in_flight=exe.positive("max_in_flight"),
        max_n=exe.positive("max_n"),
        read_batch_rows=exe.positive("read_batch_rows"),
        progress_interval_s=float(exe.get("progress_interval_s", (int, float))),
        grace_s=exe.seconds("grace_s", allow_zero=True),
        lease_s=exe.seconds("lease_s", allow_zero=False),
        dedupe_window=_dedupe_window(exe),
        dedupe_max_bytes=_dedupe_max_bytes(exe),
        prefix_window=_window(exe, "prefix_window", "0: file order"),
        engine_restarts=_engine_restarts(exe),
    )


def _engine_restarts(exe: Fields) -> int:
    value = exe.get("engine_restarts", int)
    if isinstance(value, bool) or value < 0:
        raise SpecError(
            "execution.engine_restarts",
            f"expected a number of restarts, 0 or more (0: the engine's first death ends the run), "
            f"got {value!r}",
        )
    return value


def _dedupe_window(exe: Fields) -> int:
    return _window(exe, "dedupe_window", "0: every row generated")


def _dedupe_max_bytes(exe: Fields) -> int:
    value = exe.get("dedupe_max_bytes", int)
    if isinstance(value, bool) or value < 0:
        raise SpecError(
            "execution.dedupe_max_bytes",
            f"expected a number of bytes, 0 or more (0: no finished result kept), got {value!r}",
        )
    return value


def _window(exe: Fields, key: str, zero: str) -> int:
    value = exe.get(key, int)
    if isinstance(value, bool) or value < 0:
        raise SpecError(f"execution.{key}", f"expected a number of rows, 0 or more ({zero}), got {value!r}")
    return value


def _executor_spec(raw: dict) -> ExecutorSpec:
    ex = Fields(raw, "executor", ExecutorSpec, required=False)
    kind = ex.get("kind", str)
    resources = ex.get("resources_per_replica", dict)
    for key, value in resources.items():
        if (
            not isinstance(key, str)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
        ):
            raise SpecError(
                f"executor.resources_per_replica.{key}",
                f"expected a number of {key} (0 or more), got {value!r}",
            )
    return ExecutorSpec(
        kind=kind,
        replicas=ex.positive("replicas"),
        resources_per_replica=dict(resources),
        ray_address=ex.get("ray_address", str),
        max_shard_attempts=ex.positive("max_shard_attempts"),
    )
