"""OpenAI Batch result and error files as output (``output.format: openai``,
batchspec/io/openai_results.py): every line checked by a parser written here from OpenAI's
published Batch format (not batchspec's code), every request of the input in exactly one of the
two files, both committed with the shard's manifest (a missing or changed errors file makes the
shard partial again), ``batchspec report`` reading the same figures as from Parquet, and the spec
keys that cannot apply refused. On the fake engine; the real engine's runs of such jobs are in
test_openai_batch.py (local disk) and test_stores.py (the S3 server, killed and rerun)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
from helpers.fake_runs import run
from helpers.fakes import FakeEngine
from helpers.openai_format import read_openai_output

from batchspec.columns import empty_result, error_result
from batchspec.errors import SpecError
from batchspec.report.metrics import build_report
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

MODEL = "tiny-target"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# ----------------------------------------------------------------- jobs on a fake engine


class FiguresEngine(FakeEngine):
    """The fake engine with the figures a real one gives: ``n`` samples, speculative-decoding
    and timing columns, logprobs where asked; each derived from the request id (the same in any
    run), finishing in a random order."""

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        for row, [result] in super().stream(rows, max_in_flight, stop, grace_s, keep):
            if result["error"] is not None:
                yield row, [result]
                continue
            n = row.overrides.get("n") or 1
            yield row, [self._sample(row, i, row.overrides.get("logprobs")) for i in range(n)]

    @staticmethod
    def _sample(row, index: int, logprobs: int | None) -> dict:
        h = hashlib.blake2b(f"{row.request_id}/{index}".encode(), digest_size=8).digest()
        tokens = 3 + h[0] % 6
        drafted, accepted = 4 * tokens, h[1] % (3 * tokens)
        if row.prompt is not None and "too long" in row.prompt:
            return error_result("prompt too long: 9000 tokens, the model takes 512", num_prompt_tokens=9000)
        result = empty_result()
        result.update(
            sample_index=index,
            generated_text=f"answer {row.request_id} {index}",
            finish_reason="length" if h[2] % 3 == 0 else "stop",
            num_prompt_tokens=5 + h[3] % 9,
            num_output_tokens=tokens,
            spec_num_steps=tokens,
            spec_num_draft_tokens=drafted,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / drafted,
            spec_mean_acceptance_length=1 + accepted / tokens,
            spec_acceptance_histogram=[tokens - 1, 1, 0, 0, 0],
            time_queued_s=h[4] / 1000,
            time_to_first_token_s=h[5] / 100,
            time_decode_s=h[6] / 50,
            time_e2e_s=h[5] / 100 + h[6] / 50 + 0.5,
            output_tokens_per_s=(tokens - 1) / (h[6] / 50 + 0.01),
        )
        if logprobs is not None:
            result.update(
                cumulative_logprob=-0.5 * tokens,
                token_logprobs=[-0.5] * tokens,
                top_logprobs=[
                    [{"token_id": 7, "token": "é", "logprob": -0.25, "rank": 1}] for _ in range(tokens)
                ][:tokens]
                if logprobs
                else [[]] * tokens,
                _token_texts=[f"t{i}" for i in range(tokens)],
            )
        return result


def _line(custom_id, url=CHAT, **body) -> str:
    body.setdefault("model", MODEL)
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"question {custom_id}"}])
    else:
        body.setdefault("prompt", f"prompt {custom_id}")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


#: One request file: chat and completion lines, samples, logprobs, and each kind of bad line.
REQUESTS = [
    _line("chat-1"),
    _line("text-1", url=COMPLETIONS, max_tokens=12),
    _line("chat-n3", n=3, temperature=0.7, seed=1),
    _line("chat-logprobs", logprobs=True, top_logprobs=1),
    _line("text-logprobs", url=COMPLETIONS, logprobs=1),
    _line("text-long", url=COMPLETIONS, prompt="too long " * 4),
    "{not json",
    json.dumps({"method": "POST", "url": CHAT, "body": {"model": MODEL}}),
    _line("emb", url="/v1/embeddings"),
    _line("chat-1"),
    _line("tools", tools=[]),
    _line("other-model", model="gpt-4o"),
]


def _job(tmp_path: Path, output_format: str = "openai", out: str = "out", **extra) -> dict:
    return {
        "name": "openai-out",
        "input": {"path": str(tmp_path / "in" / "*.jsonl"), "format": "openai"},
        "output": {"path": str(tmp_path / out), "format": output_format, **extra},
        "model": {"target": "unused", "engine": {"served_model_name": MODEL}},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }


def _inputs(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch-a.jsonl").write_text("\n".join(REQUESTS) + "\n")
    (tmp_path / "in" / "batch-b.jsonl").write_text(
        "\n".join(_line(f"b-{i}", url=COMPLETIONS if i % 2 else CHAT) for i in range(7)) + "\n"
    )


@pytest.mark.vllm
def test_every_request_is_in_exactly_one_file_in_openais_format(tmp_path):
    _inputs(tmp_path)
    spec = build_spec(_job(tmp_path))
    run(spec, engine=FiguresEngine(seed=3))
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "_batchspec",
        "batch-a.errors.jsonl",
        "batch-a.output.jsonl",
        "batch-b.errors.jsonl",
        "batch-b.output.jsonl",
    ]
    results, errors = read_openai_output(out, "batch-a")
    ok = {line["custom_id"]: line for line in results}
    assert sorted(ok) == ["chat-1", "chat-logprobs", "chat-n3", "text-1", "text-logprobs"]
    assert len(results) == len(ok)
    bad = [line["custom_id"] for line in errors]
    # each input line once, each custom_id on one line: the repeated chat-1 is an error line
    # with a null custom_id, as is each line without a custom_id
    assert sorted(map(str, bad)) == sorted(
        map(str, ["text-long", None, None, "emb", None, "tools", "other-model"])
    )
    assert len(results) + len(errors) == len(REQUESTS)

    chat = ok["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == MODEL
    assert chat["choices"][0]["message"]["content"] == "answer chat-1 0"
    text = ok["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "answer text-1 0"
    three = ok["chat-n3"]["response"]["body"]
    assert [c["message"]["content"] for c in three["choices"]] == [f"answer chat-n3 {i}" for i in range(3)]
    samples = ok["chat-n3"]["batchspec"]["samples"]
    assert three["usage"]["completion_tokens"] == sum(s["num_output_tokens"] for s in samples)
    assert [s["sample_index"] for s in samples] == [0, 1, 2]
    assert all(s["spec_acceptance_rate"] is not None and s["time_e2e_s"] > 0 for s in samples)
    content = ok["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "t0" and content[0]["top_logprobs"][0] == {
        "token": "é",
        "logprob": -0.25,
        "bytes": list("é".encode()),
    }
    legacy = ok["text-logprobs"]["response"]["body"]["choices"][0]["logprobs"]
    assert legacy["tokens"][:2] == ["t0", "t1"] and legacy["text_offset"][:3] == [0, 2, 4]
    assert legacy["top_logprobs"][0] == {"é": -0.25}

    by_id = {
        (
            line["custom_id"],
            (line["error"] or {}).get("code") or line["response"]["body"]["error"]["code"],
        ): line
        for line in errors
    }
    long = by_id[("text-long", "prompt_too_long")]["response"]
    assert long["status_code"] == 400
    assert long["body"]["error"]["type"] == "invalid_request_error"
    assert {code for cid, code in by_id if cid is None} == {"not_json", "no_custom_id", "duplicate_custom_id"}
    assert by_id[("tools", "unsupported_field")]["response"]["body"]["error"]["param"] == "body.tools"
    assert "line 10" in by_id[(None, "duplicate_custom_id")]["error"]["message"]
    # every id unique in the output, the same on a rerun of the run
    ids = [line["id"] for line in results + errors]
    assert len(set(ids)) == len(ids)

    results_b, errors_b = read_openai_output(out, "batch-b")
    assert sorted(line["custom_id"] for line in results_b) == [f"b-{i}" for i in range(7)]
    assert errors_b == []

    manifest = json.loads((out / "_batchspec" / "manifest" / "batch-a.json").read_text())
    assert manifest["errors_info"]["size"] == (out / "batch-a.errors.jsonl").stat().st_size
    assert manifest["metadata"]["job"] == "openai-out"
    status = job_status(spec)
    assert [s["state"] for s in status["shards"]] == ["committed", "committed"]
    assert status["shards"][0]["output"].endswith("batch-a.output.jsonl")


@pytest.mark.vllm
def test_an_errors_file_lost_or_changed_makes_its_shard_partial_and_a_rerun_redoes_it(tmp_path):
    _inputs(tmp_path)
    spec = build_spec(_job(tmp_path))
    run(spec, engine=FiguresEngine())
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.glob("*.jsonl")}
    (out / "batch-a.errors.jsonl").write_text("")
    (out / "batch-b.errors.jsonl").unlink()
    assert [s["state"] for s in job_status(spec)["shards"]] == ["partial", "partial"]
    _, events = run(spec, engine=FiguresEngine(seed=9))
    assert sorted(f["shard"] for e, f in events if e == "shard_committed") == ["batch-a", "batch-b"]
    after = {p.name: p.read_bytes() for p in out.glob("*.jsonl")}
    assert sorted(after) == sorted(before)
    for name in before:  # the same requests in each file, in this run's completion order
        assert sorted(json.loads(x)["custom_id"] or "" for x in after[name].splitlines()) == sorted(
            json.loads(x)["custom_id"] or "" for x in before[name].splitlines()
        )
    # and a third run finds both committed
    _, events = run(spec, engine=FiguresEngine())
    assert sorted(f["shard"] for e, f in events if e == "shard_skipped") == ["batch-a", "batch-b"]


@pytest.mark.vllm
def test_report_reads_the_same_figures_as_from_parquet(tmp_path):
    """The same job written both ways, by an engine whose figures depend only on the request:
    ``batchspec report``'s overall, per-shard and per-adapter figures are equal."""
    _inputs(tmp_path)
    as_openai = build_spec(_job(tmp_path))
    as_parquet = build_spec(_job(tmp_path, "parquet", out="parquet"))
    run(as_openai, engine=FiguresEngine(seed=1))
    run(as_parquet, engine=FiguresEngine(seed=2))
    a, b = build_report(str(tmp_path / "out")), build_report(str(tmp_path / "parquet"))
    assert a["files"] == b["files"] == 2
    assert a["overall"]["rows"] == b["overall"]["rows"] > 0

    def close(x, y, where=""):
        if isinstance(x, dict):
            assert sorted(x) == sorted(y), where
            for k in x:
                if k != "run_id":
                    close(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, float) and isinstance(y, float):
            assert math.isclose(x, y, rel_tol=1e-12), f"{where}: {x} != {y}"
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"

    close(a["overall"], b["overall"], "overall")
    close(a["shards"], b["shards"], "shards")
    close(a["lora_adapters"], b["lora_adapters"], "lora_adapters")
    assert a["lineage"]["job"] == b["lineage"]["job"] == ["openai-out"]


@pytest.mark.vllm
def test_report_names_a_line_it_cannot_read(tmp_path):
    from batchspec.errors import InputDataError

    _inputs(tmp_path)
    run(build_spec(_job(tmp_path)), engine=FiguresEngine())
    path = tmp_path / "out" / "batch-b.output.jsonl"
    path.write_text(path.read_text() + '{"custom_id": "x", "response": null}\n')
    with pytest.raises(InputDataError) as err:
        build_report(str(tmp_path / "out"))
    assert "batch-b.output.jsonl" in str(err.value) and "line 8" in str(err.value)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"input": {"format": None}}, "output.format"),
        ({"output": {"keep_columns": ["url"]}}, "output.keep_columns"),
        ({"output": {"compression": "gzip"}}, "output.compression"),
        ({"output": {"row_group_rows": 10}}, "output.row_group_rows"),
        ({"output": {"format": "csv"}}, "output.format"),
    ],
)
def test_keys_an_openai_output_cannot_honour_are_refused(tmp_path, change, key):
    job = _job(tmp_path)
    for section, values in change.items():
        job[section] = {k: v for k, v in {**job[section], **values}.items() if v is not None}
    if key == "output.format" and "input" in change:
        job["input"]["prompt_column"] = "prompt"
    with pytest.raises(SpecError) as err:
        build_spec(job)
    assert err.value.key == key


@pytest.mark.vllm
def test_each_custom_id_is_on_exactly_one_line_of_the_two_files(tmp_path):
    """A repeated custom_id is answered once, by the line that had it first: each repeat is an
    errors-file line with a null custom_id (as a line without a readable one), naming the line
    it repeats. Lines nested too deep or too long are error lines too, and the run goes on."""
    from collections import Counter

    deep = "[" * 5000 + "]" * 5000
    (tmp_path / "in").mkdir()
    lines = [
        deep,
        _line("r1"),
        _line("r2", url=COMPLETIONS),
        _line("r1"),
        _line("r3"),
        _line("r2", url=COMPLETIONS),
        _line("r1", model=["not", "a", "string"]),
        _line("long", metadata={"pad": "x" * 30_000}),
        _line("r4"),
    ]
    (tmp_path / "in" / "dup.jsonl").write_text("\n".join(lines) + "\n")
    job = _job(tmp_path)
    job["input"]["max_line_bytes"] = 20_000
    result, _ = run(build_spec(job), engine=FiguresEngine())
    assert result.summary["status"] == "ok"
    results, errors = read_openai_output(tmp_path / "out", "dup")
    assert len(results) + len(errors) == len(lines)
    ids = Counter(line["custom_id"] for line in results + errors)
    assert ids == {"r1": 1, "r2": 1, "r3": 1, "r4": 1, None: 5}
    assert sorted(line["custom_id"] for line in results) == ["r1", "r2", "r3", "r4"]
    assert sorted(line["error"]["message"] for line in errors) == [
        "duplicate custom_id: line 4 repeats 'r1' of line 2",
        "duplicate custom_id: line 6 repeats 'r2' of line 3",
        "duplicate custom_id: line 7 repeats 'r1' of line 2",
        f"line too long: line 8 has {len(lines[7])} bytes, more than input.max_line_bytes (20000)",
        "too deep: line 1 nests more than 48 arrays and objects",
    ]
    assert {line["error"]["code"] for line in errors} == {"duplicate_custom_id", "line_too_long", "too_deep"}


def test_a_reasoning_models_thinking_is_in_the_field_vllms_server_writes():
    from batchspec.columns import LENGTH_IN_REASONING
    from batchspec.io.openai_batch import COMPLETIONS
    from batchspec.io.openai_results import line_rows, result_line

    def sample(text, thinking, reason, tokens):
        return {
            **empty_result(),
            "generated_text": text,
            "reasoning_text": thinking,
            "finish_reason": reason,
            "num_prompt_tokens": 3,
            "num_output_tokens": sum(tokens),
            "num_reasoning_tokens": tokens[0],
            "num_answer_tokens": tokens[1],
        }

    samples = [
        sample("42", "add them", "stop", (5, 2)),
        sample(None, "still thinking", LENGTH_IN_REASONING, (9, 0)),
    ]
    line = result_line("c1", {"url": CHAT, "model": "m"}, samples, ("run", "s", "1"), 0)
    body = line["response"]["body"]
    first, cut = body["choices"]
    assert first["message"] == {
        "role": "assistant",
        "content": "42",
        "refusal": None,
        "reasoning": "add them",
    }
    # cut while thinking: OpenAI's and vLLM's server's `length`, with no content
    assert (cut["finish_reason"], cut["message"]["content"]) == ("length", None)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 14}
    back = line_rows(json.loads(json.dumps(line)))
    assert [(r["generated_text"], r["reasoning_text"], r["finish_reason"]) for r in back] == [
        ("42", "add them", "stop"),
        (None, "still thinking", LENGTH_IN_REASONING),
    ]
    # a job without a reasoning parser writes OpenAI's fields alone
    plain = result_line(
        "c2",
        {"url": COMPLETIONS, "model": "m"},
        [{**empty_result(), "generated_text": "x"}],
        ("r", "s", "2"),
        0,
    )
    assert "reasoning" not in plain["response"]["body"]["choices"][0]
    assert "completion_tokens_details" not in plain["response"]["body"]["usage"]
