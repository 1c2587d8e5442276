"""examples/requests/ run for real on the demo's kind of prompts (the session's shared engines,
so no start-up of their own): labels with choice probabilities, JSON extraction, several samples.
What each row must hold is checked from the output files as a user would read them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
import yaml
from helpers.jobs import MODELS, ROOT, read_output

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

EXAMPLES = ROOT / "examples" / "requests"
ROWS = 12


def _run(name: str, tmp_path: Path, shared_engines, adapters: tuple[str, ...] = ()) -> list[dict]:
    from demo_data import prompt_table

    (tmp_path / "in").mkdir()
    pq.write_table(
        prompt_table(ROWS, seed=4100, max_tokens=(4, 16), adapters=adapters),
        tmp_path / "in" / "part-0.parquet",
    )
    env = {
        "BATCHSPEC_DEMO_INPUT": str(tmp_path / "in" / "*.parquet"),
        "BATCHSPEC_EXAMPLE_OUTPUT": str(tmp_path / "out"),
    }
    overrides = [f"model.target={MODELS / 'target'}"]
    job = yaml.safe_load((EXAMPLES / name).read_text())
    if job["speculative"].get("model"):  # the shared engine's spelling of the same draft
        overrides.append(f"speculative.model={MODELS / 'draft'}")
    for adapter in adapters:  # and of the same adapters
        overrides.append(f"model.lora.adapters.{adapter}={MODELS / f'lora-{adapter}'}")
    spec = load_spec(EXAMPLES / name, overrides, environ=env)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    rows = read_output(tmp_path / "out").to_pylist()
    assert len({(r["id"], r["sample_index"]) for r in rows}) == len(rows)
    return rows


def test_label_example_gives_every_row_a_label_and_its_probability(tmp_path, shared_engines):
    rows = _run("label.yaml", tmp_path, shared_engines)
    labels = yaml.safe_load((EXAMPLES / "label.yaml").read_text())["sampling"]["structured_outputs"]["choice"]
    assert len(rows) == ROWS
    for row in rows:
        assert row["generated_text"] in labels and row["structured_valid"] is True, row
        probs = {p["choice"]: p["prob"] for p in row["choice_probs"]}
        assert list(probs) == labels and abs(sum(probs.values()) - 1) < 1e-6
        assert max(probs, key=probs.get) == row["generated_text"]
        assert all(len(top) == 3 for top in row["top_logprobs"])


def test_extract_example_writes_json_that_validates(tmp_path, shared_engines):
    rows = _run("extract.yaml", tmp_path, shared_engines)
    schema = yaml.safe_load((EXAMPLES / "extract.yaml").read_text())["sampling"]["structured_outputs"]["json"]
    finished = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(finished) >= ROWS // 2, [r["generated_text"] for r in rows]
    for row in rows:
        if row["finish_reason"] == "stop":
            jsonschema.validate(json.loads(row["generated_text"]), schema)
            assert row["structured_valid"] is True
        else:
            assert row["structured_valid"] is False and row["structured_error"]


def test_samples_example_writes_three_samples_per_row(tmp_path, shared_engines):
    rows = _run("samples.yaml", tmp_path, shared_engines)
    assert len(rows) == 3 * ROWS
    by_id: dict[str, list[int]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row["sample_index"])
    assert all(sorted(v) == [0, 1, 2] for v in by_id.values())


def test_lora_example_runs_each_row_with_the_adapter_it_names(tmp_path, shared_engines):
    from tiny_lora import comment_share, upper_share

    rows = _run("lora.yaml", tmp_path, shared_engines, adapters=("upper", "comment"))
    assert len(rows) == ROWS
    assert {r["adapter"] for r in rows} == {None, "upper", "comment"}
    for row in rows:
        assert row["error"] is None and row["lora_adapter"] == row["adapter"], row
        assert row["spec_num_steps"] is not None  # speculation on (a row may end at once)
    for adapter in ("upper", "comment", None):  # the draft proposed for every kind of row
        assert sum(r["spec_num_draft_tokens"] for r in rows if r["adapter"] == adapter) > 0
    share = {"upper": upper_share, "comment": comment_share}
    for adapter, score in share.items():
        texts = [r["generated_text"] for r in rows if r["adapter"] == adapter]
        assert sum(map(score, texts)) / len(texts) >= 0.6, (adapter, texts)
        base = [r["generated_text"] for r in rows if r["adapter"] is None]
        assert sum(map(score, base)) / len(base) <= 0.3, (adapter, base)


def test_openai_batch_example_answers_a_request_file_on_object_storage_beside_it(
    tmp_path, shared_engines, s3_server, monkeypatch
):
    """examples/openai-batch: its sample request file put on the S3 server, the example spec
    run as a user would (credentials from the environment): results and errors beside it, in
    OpenAI's format (tests/helpers/openai_format.py), each custom_id once, what each line asked
    for answered."""
    import s3fs
    from helpers.jobs import S3_KEY, S3_SECRET
    from helpers.openai_format import read_openai_output

    endpoint, options = s3_server
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir("openai-example")
    requests = (ROOT / "examples" / "openai-batch" / "requests.jsonl").read_text()
    batch_dir = "s3://openai-example/batches/2026-11-25"
    fs.pipe(f"{batch_dir}/requests/requests.jsonl", requests.encode())
    env = {
        "BATCH_DIR": batch_dir,
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "BATCHSPEC_TARGET": str(MODELS / "target"),
        "BATCHSPEC_DRAFT": str(MODELS / "draft"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = load_spec(ROOT / "examples" / "openai-batch" / "batch.yaml", environ=env)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    assert sorted(fs.ls(f"{batch_dir}/results")) == sorted(
        f"{batch_dir[5:]}/results/{name}"
        for name in ("_batchspec", "requests.errors.jsonl", "requests.output.jsonl")
    )
    results, errors = read_openai_output(f"{batch_dir}/results", "requests", fs=fs)
    asked = [json.loads(line) for line in requests.splitlines()]
    assert sorted(line["custom_id"] for line in results + errors) == sorted(
        line["custom_id"] for line in asked
    )
    assert [line["custom_id"] for line in errors] == ["embed-1"]
    body = {line["custom_id"]: line["response"]["body"] for line in results}
    assert all(b["model"] == "tiny-coder" for b in body.values())
    assert len(body["samples-3"]["choices"]) == 3
    [choice] = body["logprobs-1"]["choices"]
    assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
    [choice] = body["json-1"]["choices"]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(
            json.loads(choice["message"]["content"]),
            asked[5]["body"]["response_format"]["json_schema"]["schema"],
        )
    assert body["complete-1"]["object"] == "text_completion"
    assert body["explain-2"]["usage"]["completion_tokens"] <= 24
