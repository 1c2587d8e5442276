"""OpenAI Batch request files as input (``input.format: openai``).

Each line is one request as OpenAI's Batch API takes it::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "NAME", "messages": [...], "max_tokens": 64, ...}}

``/v1/chat/completions`` renders ``body.messages`` with the target's chat template;
``/v1/completions`` sends ``body.prompt`` as text; with ``task: embed``, ``/v1/embeddings``
embeds ``body.input`` (one string a line; ``encoding_format`` ``float`` or ``base64``, and
``dimensions`` where it is the job's), and is the one URL such a job runs. ``custom_id`` is the
row's request id.
``body.model`` must be a name the job serves (:func:`served_names`): the target, or
``model.engine.served_model_name``, or a LoRA adapter's name in ``model.lora.adapters`` (the
line then runs with that adapter); any other name is an error line, never a silent substitution.
The body's sampling fields become the row's SamplingParams overrides (:data:`CHAT_FIELDS`,
:data:`COMPLETION_FIELDS`); a field the line leaves out takes the job's ``sampling`` value.

Every problem of a line is an error row naming the line and the field: not JSON (or nested
deeper, or longer, than :mod:`batchspec.io.jsonl` reads), no ``custom_id``, a ``custom_id`` an
earlier line of the file has, a method other than POST, a URL the job's task does not run
(``/v1/embeddings`` in a generation job, a chat line in an embedding job), an unknown or
unsupported body field, a value of the wrong JSON type. No line
raises out of the reader. The rest of the file runs. The output keeps ``url`` and ``model`` of
each line.

Each ``custom_id`` is answered once: a line repeating an earlier line's id is an error whose
output line has a null ``custom_id`` (:data:`NO_CUSTOM_ID`). The ids seen are kept as 8-byte
digests with the line that had each first, about 120 bytes an id whatever its length (a
collision, odds of about 3 in 10^8 for a file of a million ids, would take a line for a repeat).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from batchspec.errors import quoted
from batchspec.io.jsonl import BadLine, JsonLinesReader, cut_text, unreadable
from batchspec.io.records import Shard
from batchspec.io.rows import Row, id_digest, set_messages
from batchspec.redact import sanitize_url
from batchspec.spec.model import JobSpec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
#: The URLs each task runs.
TASK_URLS = {"generate": (CHAT, COMPLETIONS), "embed": (EMBEDDINGS,)}
#: Embeddings body fields batchspec runs (beside ``model`` and ``input``).
EMBEDDING_FIELDS = ("encoding_format", "dimensions")

#: Body fields of both endpoints that map to a SamplingParams field of the same meaning.
_SAMPLING = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
#: Chat body fields batchspec runs (beside ``model`` and ``messages``).
CHAT_FIELDS = (
    *_SAMPLING,
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    # vLLM's server's own: the chat template's variables, and a reasoning model's thinking budget
    "chat_template_kwargs",
    "thinking_token_budget",
)
#: Completions body fields batchspec runs (beside ``model`` and ``prompt``).
COMPLETION_FIELDS = (*_SAMPLING, "logprobs")
#: The body field each of a line's sampling overrides comes from, as the row's error names it.
OVERRIDE_FIELDS = {
    **{key: f"body.{name}" for name, key in _SAMPLING.items()},
    "logprobs": "body.logprobs",
    "structured_outputs": "body.response_format",
    "chat_template_kwargs": "body.chat_template_kwargs",
    "thinking_token_budget": "body.thinking_token_budget",
    "encoding_format": "body.encoding_format",
}
#: Body fields that change nothing batchspec generates: accepted and left alone.
_NO_EFFECT = ("user", "metadata", "store")

#: Error categories of a line that answers no ``custom_id``: its ``custom_id`` could not be read
#: (its request id is then ``<shard>/<index>``, not a ``custom_id``), or an earlier line of the
#: file has it (that line answers it). Their output lines have a null ``custom_id``.
NO_CUSTOM_ID = (
    "not JSON",
    "not UTF-8",
    "not an object",
    "no custom_id",
    "too deep",
    "line too long",
    "unreadable line",
    "duplicate custom_id",
)

#: The columns kept from each line.
KEPT = [pa.field("url", pa.string()), pa.field("model", pa.string())]


def served_names(spec: JobSpec) -> dict[str, str | None]:
    """``body.model`` values a job answers: name -> the LoRA adapter the line runs with (None:
    the job's model, with ``model.lora.adapter`` where that is set)."""
    served = spec.model.engine.get("served_model_name") or spec.model.target
    names: dict[str, str | None] = dict.fromkeys([served] if isinstance(served, str) else list(served))
    if spec.model.lora is not None:
        names.update({name: name for name in spec.model.lora.adapters})
    return names


class _LineError(Exception):
    """What is wrong with one line (its message names the line)."""


def _json_type(value: Any) -> str:
    """The JSON type of a parsed value, by JSON's names."""
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
    }.get(type(value), type(value).__name__)


class OpenAIBatchReader(JsonLinesReader):
    """Reads an OpenAI Batch request file's lines as rows (the interface of
    :class:`~batchspec.io.reader.ParquetReader`)."""

    def __init__(self, shard: Shard, spec: JobSpec, batch_rows: int = 1024):
        self.served = served_names(spec)
        self.urls = TASK_URLS.get(spec.task, ())
        self.dimensions = spec.dimensions
        # custom_id's 8-byte digest -> the line that had it first
        self._first_line: dict[bytes, int] = {}
        super().__init__(shard, spec.input, spec.output, batch_rows)

    def _columns(self, head, output_spec) -> list[pa.Field]:
        return list(KEPT)

    def _row(self, index: int, number: int, record: Any) -> Row:
        name = self.shard.name
        row = Row(shard=name, index=index, request_id=f"{name}/{index}", kept={"url": None, "model": None})
        if isinstance(record, BadLine):
            row.error = record.why
            return row
        try:
            self._read_line(row, number, record)
        except _LineError as exc:
            row.error = str(exc)
        except Exception as exc:  # no line raises out of the reader
            row.error = (
                unreadable(number, exc)
                if row.request_id == f"{name}/{index}"
                else f"bad line: line {number} ({type(exc).__name__}: {cut_text(str(exc))})"
            )
        return row

    def _read_line(self, row: Row, number: int, record: Any) -> None:
        if not isinstance(record, dict):
            raise _LineError(f"not an object: line {number} is a JSON {type(record).__name__}")
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise _LineError(
                f"no custom_id: line {number} has {'none' if custom_id is None else quoted(custom_id)}"
            )
        row.request_id = custom_id
        key = id_digest(custom_id)
        first = self._first_line.setdefault(key, number)
        if first != number:
            raise _LineError(
                f"duplicate custom_id: line {number} repeats {quoted(custom_id)} of line {first}"
            )
        unknown = sorted(set(record) - {"custom_id", "method", "url", "body"})
        if unknown:
            raise _LineError(f"unknown field: line {number}, {quoted(unknown[0])}")
        if record.get("method") != "POST":
            raise _LineError(f"unsupported method: line {number}, {quoted(record.get('method'))} (POST only)")
        url = record.get("url")
        row.kept["url"] = url if isinstance(url, str) else None
        if url not in self.urls:
            raise _LineError(
                f"unsupported url: line {number}, {quoted(url)} (this job runs {' and '.join(self.urls)})"
            )
        body = record.get("body")
        if not isinstance(body, dict):
            raise _LineError(f"no body: line {number} has no JSON object in body")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _LineError(
                f"bad value: line {number}, body.model must be a string, not a JSON {_json_type(model)}"
            )
        # kept, and echoed in the result's body: a model named as a URL may carry a login
        row.kept["model"] = sanitize_url(model) if model is not None else None
        if model not in self.served:
            raise _LineError(
                f"unknown model: line {number}, body.model "
                f"{quoted(sanitize_url(model) if model else model)} is not one this "
                f"job serves ({', '.join(repr(sanitize_url(n)) for n in self.served)})"
            )
        row.lora = self.served[model]
        if url == EMBEDDINGS:
            self._embedding(row, number, body)
            return
        if url == CHAT:
            _messages(row, body.get("messages"), number)
            fields = CHAT_FIELDS
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _LineError(f"bad prompt: line {number}, body.prompt must be one string")
            if not prompt.strip():
                raise _LineError(f"empty prompt: line {number}")
            row.prompt = prompt
            fields = COMPLETION_FIELDS
        for key, value in body.items():
            if key in ("model", "messages", "prompt", *_NO_EFFECT) or value is None:
                continue
            if key == "stream" and value is False:
                continue
            if key not in fields:
                raise _LineError(
                    f"unsupported field: line {number}, body.{key} ({url} fields "
                    f"batchspec runs: {', '.join(fields)})"
                )
            _sampling(row.overrides, key, value, body, number, chat=url == CHAT)

    def _embedding(self, row: Row, number: int, body: dict) -> None:
        text = body.get("input")
        if isinstance(text, list):
            raise _LineError(
                f"bad input: line {number}, body.input is a list (batchspec embeds one string a line)"
            )
        if not isinstance(text, str):
            raise _LineError(f"bad input: line {number}, body.input must be one string")
        if not text.strip():
            raise _LineError(f"empty prompt: line {number}")
        row.prompt = text
        for key, value in body.items():
            if key in ("model", "input", *_NO_EFFECT) or value is None:
                continue
            if key not in EMBEDDING_FIELDS:
                raise _LineError(
                    f"unsupported field: line {number}, body.{key} ({EMBEDDINGS} fields "
                    f"batchspec runs: {', '.join(EMBEDDING_FIELDS)})"
                )
            if key == "encoding_format" and value not in ("float", "base64"):
                raise _LineError(f"bad value: line {number}, body.encoding_format must be float or base64")
            if key == "dimensions" and value != self.dimensions:
                raise _LineError(
                    f"bad value: line {number}, body.dimensions {quoted(value)}: this job embeds "
                    f"{self.dimensions} dimensions (pooling.dimensions)"
                )
        # how the result line gives the vector (io/openai_results.py)
        row.overrides["encoding_format"] = body.get("encoding_format") or "float"


def _messages(row: Row, messages: Any, number: int) -> None:
    """The row's chat messages: text content, or OpenAI's text and ``image_url`` parts (the
    images read when the row is generated: batchspec/io/images.py)."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise _LineError(f"bad messages: line {number}, body.messages is not a list of objects")
    problem = set_messages(row, [dict(m) for m in messages])
    if problem:
        raise _LineError(f"{problem.replace(' messages[', ' body.messages[', 1)}: line {number}")


def _sampling(overrides: dict[str, Any], key: str, value: Any, body: dict, number: int, chat: bool) -> None:
    """One body field as SamplingParams overrides (vLLM checks the values themselves)."""
    where = f"line {number}, body.{key}"
    if key in _SAMPLING:
        overrides[_SAMPLING[key]] = value
    elif key == "max_completion_tokens":
        if "max_tokens" in body and body["max_tokens"] is not None:
            raise _LineError(f"two limits: {where} and body.max_tokens are both set")
        overrides["max_tokens"] = value
    elif key == "logprobs" and chat:  # true/false; top_logprobs says how many
        if not isinstance(value, bool):
            raise _LineError(f"bad value: {where} must be true or false")
        if value:
            overrides["logprobs"] = body.get("top_logprobs") or 0
    elif key == "logprobs":  # completions: how many
        overrides["logprobs"] = value
    elif key == "top_logprobs":
        if not body.get("logprobs"):
            raise _LineError(f"bad value: {where} needs body.logprobs true")
    elif key in ("chat_template_kwargs", "thinking_token_budget"):
        overrides[key] = value
    elif key == "response_format":
        overrides.update(_response_format(value, where))


def _response_format(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _LineError(
            f"bad value: {where} must be an object whose type is text, json_object or json_schema"
        )
    if value["type"] == "text":
        return {}
    if value["type"] == "json_object":
        return {"structured_outputs": {"json_object": True}}
    schema = (
        (value.get("json_schema") or {}).get("schema")
        if isinstance(value.get("json_schema"), Mapping)
        else None
    )
    if not isinstance(schema, Mapping):
        raise _LineError(f"bad value: {where}.json_schema.schema must be a JSON schema object")
    return {"structured_outputs": {"json": dict(schema)}}
