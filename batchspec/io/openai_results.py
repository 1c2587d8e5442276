"""OpenAI Batch result and error files as output (``output.format: openai``).

Each input shard (an OpenAI Batch request file) gets two files, committed together with its
manifest, as OpenAI's Batch API returns them:

- ``<stem>.output.jsonl``: one line per request that succeeded::

    {"id": "batch_req_...", "custom_id": "r1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...",
                  "body": {"object": "chat.completion", "choices": [...], "usage": {...}, ...}},
     "batchspec": {"samples": [{"spec_acceptance_rate": 0.8, "time_e2e_s": 0.2, ...}]}}

  ``body`` is a ``chat.completion`` (``/v1/chat/completions``) or a ``text_completion``
  (``/v1/completions``) object with one choice per sample (``n``), or (``/v1/embeddings``, a
  job of ``task: embed``) a ``list`` of one ``embedding`` (floats, or base64 of little-endian
  float32 where the line asked ``encoding_format: base64``) and its ``usage``, each with its
  ``finish_reason`` and, where the line asked, its ``logprobs`` in that endpoint's shape.
  ``batchspec`` is a field OpenAI's format does not have (its readers ignore unknown fields): the
  per-sample columns of docs/contract.md that the body has no place for (speculative decoding,
  timing, structured-output check, LoRA adapter), so ``batchspec report`` reads the same figures
  from these files as from Parquet.
- ``<stem>.errors.jsonl``: one line per request that failed, ``response.status_code`` 400 (the
  line or its prompt was refused) or 500 (the engine failed it) and ``response.body.error``
  (``message``, ``type``, ``param``, ``code``). A line that names no ``custom_id`` (not JSON, not
  an object, none given) or repeats an earlier line's (that line answers it: each ``custom_id``
  is on one line of the two files) has ``"custom_id": null``, ``"response": null`` and the
  top-level ``error`` (``code``, ``message``) OpenAI uses for failures that are not an HTTP
  response.

Every line of the input is in exactly one of the two files; the ids of a line's output are
derived from the run id, the shard and the line's place in it (unique where the input repeats
a ``custom_id``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

from batchspec.columns import ERROR, LENGTH_IN_REASONING, REQUEST_ID, RESULT_NAMES, error_reason
from batchspec.io.openai_batch import CHAT, EMBEDDINGS, NO_CUSTOM_ID
from batchspec.io.output_dir import OutputDir, tmp_file_name
from batchspec.io.records import Shard
from batchspec.io.rows import Row
from batchspec.io.writer import committed_info
from batchspec.redact import sanitize_url

#: The field of each line that carries batchspec's per-sample columns.
EXTRA = "batchspec"
#: Result columns the body holds (text, finish reason, logprobs, usage) or the line's error does:
#: the rest are kept under :data:`EXTRA`.
_IN_BODY = {
    "generated_text",
    "reasoning_text",
    "finish_reason",
    "token_logprobs",
    "top_logprobs",
    "error",
    "prompt_token_logprobs",
    "prompt_top_logprobs",
}
EXTRA_COLUMNS = [name for name in RESULT_NAMES if name not in _IN_BODY]
#: The tokens a sample's logprobs are for, as text (set by batchspec.engine.rows where a row asked
#: for logprobs; not a Parquet column: OpenAI's logprobs name each token).
TOKEN_TEXTS = "_token_texts"

_PARAM = re.compile(r"\bbody(?:\.\w+)+")


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=12).hexdigest()


class OpenAIResultWriter:
    """Streams one shard's results to temporary result and error files, then commits both (a
    :class:`batchspec.io.output_formats.ResultWriter`, as :class:`batchspec.io.writer.ParquetWriter`
    is)."""

    def __init__(self, out: OutputDir, shard: Shard, metadata: dict[str, Any]):
        self.out, self.shard, self.metadata = out, shard, metadata
        self.run_id = str(metadata.get("run_id") or "")
        self.created = int(time.time())
        tmp = out.tmp_dir()
        self.tmp_paths = {
            part: os.path.join(tmp, tmp_file_name(shard.name, suffix))
            for part, suffix in out.format.parts.items()
        }
        self._files = {k: open(p, "wb") for k, p in self.tmp_paths.items()}

    def add_request(self, row: Row, results: list[dict]) -> None:
        """One input line's results (one per sample) as one result or error line."""
        failed = next((r for r in results if r.get(ERROR)), None)
        # unique in the output even where the input repeats a custom_id; a rerun gives the same
        key = (self.run_id, row.shard, str(row.index))
        if failed is not None:
            line, name = error_line(row.request_id, row.kept, failed, key), "errors"
        elif row.kept.get("url") == EMBEDDINGS:
            encoding = row.overrides.get("encoding_format", "float")
            line, name = embedding_line(row.request_id, row.kept, results[0], key, encoding), "output"
        else:
            line, name = result_line(row.request_id, row.kept, results, key, self.created), "output"
        self._files[name].write(json.dumps(line, ensure_ascii=False, allow_nan=False).encode() + b"\n")

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def commit(self) -> dict[str, Any]:
        """Make the errors file, then the results file visible (each in one step); the manifest
        written after them is the commit (a crash between leaves the shard ``partial``: the
        caller removed any earlier manifest first, and the new one binds each file by its size
        and identity, :meth:`OutputDir.file_info`). Returns the manifest's fields for both
        files and the output's lineage (``metadata``: what a Parquet file keeps in its
        footer)."""
        for f in self._files.values():
            f.close()
        paths = self.out.part_paths(self.shard)
        errors, output = paths["errors"], paths["output"]
        self.out.publish(self.tmp_paths["errors"], errors)
        self.out.publish(self.tmp_paths["output"], output)
        return {
            "output": sanitize_url(output),
            "output_info": committed_info(self.out, output),
            "errors_output": sanitize_url(errors),
            "errors_info": committed_info(self.out, errors),
            "metadata": self.metadata,
        }

    def discard(self) -> None:
        """Drop the temporary files: nothing of this shard becomes visible."""
        for name, f in self._files.items():
            try:
                f.close()
            except OSError:
                pass
            try:
                os.unlink(self.tmp_paths[name])
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- lines


def _extra(results: list[dict]) -> dict[str, Any]:
    return {"samples": [{k: r.get(k) for k in EXTRA_COLUMNS} for r in results]}


def result_line(
    request_id: str, kept: dict, results: list[dict], key: tuple[str, ...], created: int
) -> dict[str, Any]:
    """The result line of a request whose every sample succeeded; ``key`` (run id, shard, line)
    makes its ids."""
    chat = kept.get("url") == CHAT
    first = results[0]
    prompt_tokens = first.get("num_prompt_tokens") or 0
    completion_tokens = sum(r.get("num_output_tokens") or 0 for r in results)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + _digest(*key, "body"),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": kept.get("model"),
        "choices": [_chat_choice(i, r) if chat else _text_choice(i, r) for i, r in enumerate(results)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }
    if any(r.get("num_reasoning_tokens") is not None for r in results):
        # OpenAI's count of a reasoning model's thinking
        reasoning_tokens = sum(r.get("num_reasoning_tokens") or 0 for r in results)
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return {
        "id": "batch_req_" + _digest(*key),
        "custom_id": request_id,
        "response": {"status_code": 200, "request_id": "req_" + _digest(*key, "r"), "body": body},
        "error": None,
        EXTRA: _extra(results),
    }


def embedding_line(
    request_id: str, kept: dict, result: dict, key: tuple[str, ...], encoding: str
) -> dict[str, Any]:
    """The result line of an embedding request (OpenAI's ``CreateEmbeddingResponse`` body)."""
    vector = result["embedding"]
    if encoding == "base64":
        import base64
        import struct

        vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    tokens = result.get("num_prompt_tokens") or 0
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": kept.get("model"),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    extra = {k: result.get(k) for k in ("time_e2e_s", "twin_of")}
    return {
        "id": "batch_req_" + _digest(*key),
        "custom_id": request_id,
        "response": {"status_code": 200, "request_id": "req_" + _digest(*key, "r"), "body": body},
        "error": None,
        EXTRA: {"samples": [extra]},
    }


def _finish(result: dict) -> str:
    # OpenAI's and vLLM's server's word for an output cut while thinking: `length`, with no content
    reason = result.get("finish_reason") or "stop"
    return "length" if reason == LENGTH_IN_REASONING else reason


def _reasoning(message: dict) -> dict[str, Any]:
    """A reasoning model's thinking, in the field vLLM's OpenAI server writes it (``reasoning``);
    absent where the job has no reasoning parser."""
    return {} if message.get("reasoning_text") is None else {"reasoning": message["reasoning_text"]}


def _chat_choice(index: int, r: dict) -> dict[str, Any]:
    logprobs = None
    if r.get("token_logprobs") is not None:
        texts = r.get(TOKEN_TEXTS) or [None] * len(r["token_logprobs"])
        tops = r.get("top_logprobs") or [None] * len(r["token_logprobs"])
        logprobs = {
            "content": [
                {**_token(text, lp), "top_logprobs": [_token(t["token"], t["logprob"]) for t in (top or [])]}
                for text, lp, top in zip(texts, r["token_logprobs"], tops, strict=False)
            ],
            "refusal": None,
        }
    return {
        "index": index,
        "message": {
            "role": "assistant",
            "content": r.get("generated_text"),
            "refusal": None,
            **_reasoning(r),
        },
        "logprobs": logprobs,
        "finish_reason": _finish(r),
    }


def _token(text: str | None, logprob: float | None) -> dict[str, Any]:
    # OpenAI's value for a token too unlikely to have a finite logprob
    return {
        "token": text or "",
        "logprob": -9999.0 if logprob is None else logprob,
        "bytes": list((text or "").encode("utf-8")),
    }


def _text_choice(index: int, r: dict) -> dict[str, Any]:
    logprobs = None
    if r.get("token_logprobs") is not None:
        texts = [t or "" for t in (r.get(TOKEN_TEXTS) or [""] * len(r["token_logprobs"]))]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        logprobs = {
            "tokens": texts,
            "token_logprobs": r["token_logprobs"],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in (top or [])}
                for top in (r.get("top_logprobs") or [None] * len(texts))
            ],
            "text_offset": offsets,
        }
    return {
        "index": index,
        "text": r.get("generated_text"),
        **_reasoning(r),
        "logprobs": logprobs,
        "finish_reason": _finish(r),
    }


def error_line(request_id: str, kept: dict, result: dict, key: tuple[str, ...]) -> dict[str, Any]:
    """The errors-file line of a request that failed (``result`` is its failed sample); ``key``
    (run id, shard, line) makes its ids."""
    message = result[ERROR]
    category = error_reason(message)
    code = re.sub(r"[^a-z0-9]+", "_", category.lower()).strip("_") or "error"
    line_id = "batch_req_" + _digest(*key)
    if category in NO_CUSTOM_ID:  # no custom_id to answer: not an HTTP response to a request
        return {
            "id": line_id,
            "custom_id": None,
            "response": None,
            "error": {"code": code, "message": message},
            EXTRA: {REQUEST_ID: request_id, **_extra([result])},
        }
    server = category == "engine error"
    param = _PARAM.search(message)
    body = {
        "error": {
            "message": message,
            "type": "server_error" if server else "invalid_request_error",
            "param": param.group(0) if param else None,
            "code": code,
        }
    }
    return {
        "id": line_id,
        "custom_id": request_id,
        "response": {
            "status_code": 500 if server else 400,
            "request_id": "req_" + _digest(*key, "r"),
            "body": body,
        },
        "error": None,
        EXTRA: _extra([result]),
    }


# --------------------------------------------------------------------------- reading back


def line_rows(line: dict[str, Any]) -> list[dict[str, Any]]:
    """A result or errors-file line as the contract's rows (one per sample): what the Parquet
    output of the same request holds, for ``batchspec report``. Raises ValueError for a line
    that is not one batchspec wrote."""
    extra = line.get(EXTRA)
    if not isinstance(extra, dict) or not isinstance(extra.get("samples"), list):
        raise ValueError(f"no {EXTRA!r} field: not a line batchspec wrote")
    request_id = line.get("custom_id") or extra.get(REQUEST_ID)
    response = line.get("response") or {}
    body = response.get("body") or {}
    rows = []
    if "choices" in body:
        for sample, choice in zip(extra["samples"], body["choices"], strict=True):
            part = choice["message"] if "message" in choice else choice
            text = part.get("content") if "message" in choice else part.get("text")
            reasoning = part.get("reasoning")
            finish = choice.get("finish_reason")
            if finish == "length" and text is None and reasoning is not None:
                finish = LENGTH_IN_REASONING  # as _finish wrote it
            rows.append(
                {
                    REQUEST_ID: request_id,
                    **sample,
                    "generated_text": text,
                    "reasoning_text": reasoning,
                    "finish_reason": finish,
                }
            )
        return rows
    error = (body.get("error") or line.get("error") or {}).get("message")
    return [
        {REQUEST_ID: request_id, **sample, "finish_reason": "error", ERROR: error}
        for sample in extra["samples"]
    ]
