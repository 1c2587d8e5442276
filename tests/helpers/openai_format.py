"""A parser of OpenAI Batch output and error files written from OpenAI's published format (the
Batch API's output file lines, the chat completion and completion objects), not from batchspec's
code: what a downstream reader of those files accepts, line by line."""

from __future__ import annotations

import json
from pathlib import Path

#: finish_reason values of OpenAI's chat completion and completion objects.
FINISH = {"stop", "length", "content_filter", "tool_calls", "function_call"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_token(t: dict, where: str) -> None:
    assert isinstance(t["token"], str), where
    assert isinstance(t["logprob"], float) and t["logprob"] <= 0, where
    assert t["bytes"] is None or all(_is_int(b) and 0 <= b < 256 for b in t["bytes"]), where


def parse_result_line(raw: str) -> dict:
    """One line of an OpenAI Batch output file: ``{id, custom_id, response: {status_code,
    request_id, body}, error: null}`` with a ``chat.completion`` or ``text_completion`` body.
    Returns the line; fails the test where the format is broken."""
    line = json.loads(raw)
    for key in ("id", "custom_id", "response", "error"):
        assert key in line, f"no {key}: {raw}"
    assert isinstance(line["id"], str) and isinstance(line["custom_id"], str)
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and isinstance(response["request_id"], str)
    body = response["body"]
    assert isinstance(body["id"], str) and _is_int(body["created"]) and isinstance(body["model"], str)
    chat = body["object"] == "chat.completion"
    assert chat or body["object"] == "text_completion", body["object"]
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    for choice in body["choices"]:
        assert choice["finish_reason"] in FINISH, choice["finish_reason"]
        if chat:
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
            if choice["logprobs"] is not None:
                for t in choice["logprobs"]["content"]:
                    _check_token(t, raw)
                    for top in t["top_logprobs"]:
                        _check_token(top, raw)
        else:
            assert isinstance(choice["text"], str)
            lp = choice["logprobs"]
            if lp is not None:
                n = len(lp["tokens"])
                assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
                assert all(isinstance(t, str) for t in lp["tokens"])
                assert lp["text_offset"] == sorted(lp["text_offset"])
    usage = body["usage"]
    assert all(_is_int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return line


def parse_error_line(raw: str) -> dict:
    """One line of an OpenAI Batch error file: a response with a 4xx/5xx status and an
    ``error`` body (``message``, ``type``, ``param``, ``code``), or no response and a top-level
    ``error`` (``code``, ``message``)."""
    line = json.loads(raw)
    for key in ("id", "custom_id", "response", "error"):
        assert key in line, f"no {key}: {raw}"
    if line["response"] is None:
        assert isinstance(line["error"]["code"], str) and isinstance(line["error"]["message"], str)
        return line
    assert line["error"] is None and isinstance(line["custom_id"], str)
    assert 400 <= line["response"]["status_code"] < 600
    error = line["response"]["body"]["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return line


def read_openai_output(out: Path | str, stem: str, fs=None) -> tuple[list[dict], list[dict]]:
    """The result and error lines of one shard (in ``out``, on ``fs`` if given), each checked
    against the format."""

    def text(name: str) -> str:
        path = f"{out}/{name}"
        return fs.cat(path).decode() if fs is not None else Path(path).read_text()

    results = [parse_result_line(raw) for raw in text(f"{stem}.output.jsonl").splitlines() if raw.strip()]
    errors = [parse_error_line(raw) for raw in text(f"{stem}.errors.jsonl").splitlines() if raw.strip()]
    return results, errors
