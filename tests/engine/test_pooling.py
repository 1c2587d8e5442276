"""The pooling tasks on the real engine (vLLM's pooling runner, CPU build): ``task: embed`` with
the tiny target converted to embed, ``classify`` with the tiny classifier (`make models`),
``score`` with the embedding model and with the tiny cross-encoder. Each result is checked
against vLLM's own ``LLM.embed``,
``LLM.classify`` and ``LLM.score`` on the same engine; bad rows are error rows and the run goes
on; the vectors land in Lance and Delta as vectors; an embedding job killed with SIGKILL and
rerun under ``--executor ray`` holds every row once (docs/pooling.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from helpers.jobs import (
    ENGINE,
    INLINE_ENGINE,
    MODELS,
    read_output,
    run_cli,
    run_cli_in_process,
    write_job,
    write_parquet,
)
from helpers.recovery import Job
from helpers.tables import iceberg_catalog

from batchspec.spec.build import build_spec

pytestmark = pytest.mark.engine

TEXTS = [
    "def add(a, b):\n    return a + b",
    "import os\nprint(os.getcwd())",
    "The river runs past an old mill where children play.",
    '{"id": 3, "name": "mill", "ok": true}',
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y",
    "for i in range(10):\n    total += i",
    "A quiet town keeps its market open on sundays.",
    '[{"count": 7}, {"tags": [1, 1]}]',
]
#: a prompt longer than max_model_len (512 tokens)
TOO_LONG = "x = 1\n" * 600


def _spec(tmp_path, task: str, inp: dict, out: dict | None = None, target: str = "target", **extra):
    return build_spec(
        {
            "name": f"pooling-{task}",
            "task": task,
            "input": {"path": str(tmp_path / "in" / "*.parquet"), **inp},
            "output": {"path": str(tmp_path / "out"), **(out or {})},
            "model": {"target": str(MODELS / target), "engine": dict(ENGINE)},
            **extra,
        }
    )


def _by_id(table: pa.Table) -> dict[str, dict]:
    return {r["request_id"]: r for r in table.to_pylist()}


def test_embeddings_are_vllms_own_and_bad_rows_are_errors(tmp_path, shared_engines):
    prompts = [*TEXTS, TEXTS[0], "", None, TOO_LONG]
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts, "topic": ["t"] * len(prompts)},
    )
    spec = _spec(tmp_path, "embed", {"prompt_column": "prompt", "id_column": "id"})
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    table = read_output(tmp_path / "out")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 256)
    assert "generated_text" not in table.schema.names and "topic" in table.schema.names
    rows = _by_id(table)
    assert len(rows) == len(prompts)  # every row once, the bad ones too
    want = shared_engines.engine(spec).llm.embed(TEXTS, use_tqdm=False)
    for i, ref in enumerate(want):
        got = rows[f"r{i}"]
        assert got["error"] is None and got["finish_reason"] == "stop"
        assert np.allclose(got["embedding"], ref.outputs.embedding, atol=1e-5), i
        assert got["num_prompt_tokens"] == len(ref.prompt_token_ids) and got["time_e2e_s"] > 0
    twin = rows[f"r{len(TEXTS)}"]  # the duplicate of r0: embedded once
    assert twin["twin_of"] == "r0" and twin["embedding"] == rows["r0"]["embedding"]
    errors = {rid: rows[rid]["error"] for rid in ("r9", "r10", "r11")}
    assert errors["r9"] == "empty prompt" and errors["r10"] == "null prompt", errors
    assert errors["r11"].startswith("prompt too long: ") and "max_model_len 512" in errors["r11"], errors
    summary = run.summary
    assert summary["totals"]["rows"] == len(prompts) and summary["totals"]["errors"] == 3
    report = run_cli_in_process("report", str(tmp_path / "out"), "--format", "json")
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)
    assert shown["task"] == "embed" and shown["lineage"]["task"] == ["embed"]
    assert shown["shards"]["a"]["rows_per_s"] > 0 and shown["shards"]["a"]["prompt_tokens_per_s"] > 0


@pytest.mark.parametrize("fmt", ["lance", "delta", "iceberg"])
def test_embeddings_land_in_a_table_as_vectors_and_the_nearest_rows_are_found(tmp_path, shared_engines, fmt):
    write_parquet(tmp_path / "in" / "a.parquet", {"doc": [f"d{i}" for i in range(len(TEXTS))], "text": TEXTS})
    catalog = iceberg_catalog(tmp_path)
    out = {"format": fmt, **({"table": "ns.vectors", "catalog": catalog} if fmt == "iceberg" else {})}
    spec = _spec(tmp_path, "embed", {"prompt_column": "text", "id_column": "doc"}, out)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    if fmt == "lance":
        import lance

        table = lance.dataset(str(tmp_path / "out")).to_table()
    elif fmt == "delta":
        from deltalake import DeltaTable

        table = DeltaTable(str(tmp_path / "out")).to_pyarrow_table()
    else:
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **catalog).load_table("ns.vectors").scan().to_arrow()
    import polars as pl

    frame = pl.from_arrow(table)
    if fmt == "lance":  # a vector column; Delta and Iceberg have no fixed-size list: float32 lists
        assert table.schema.field("embedding").type.list_size == 256
        assert frame["embedding"].dtype == pl.Array(pl.Float32, 256)
        frame = frame.with_columns(pl.col("embedding").arr.to_list())
    assert frame["embedding"].list.len().unique().to_list() == [256]
    query = np.array(frame.filter(pl.col("doc") == "d0")["embedding"][0])
    scores = frame.select(
        "doc",
        cosine=pl.col("embedding").map_elements(
            lambda v: float(np.dot(v, query) / (np.linalg.norm(v) * np.linalg.norm(query))),
            return_dtype=pl.Float64,
        ),
    )
    assert scores.sort("cosine", descending=True)["doc"][0] == "d0"


def test_classification_is_vllms_own_with_the_models_labels(tmp_path, shared_engines):
    import sys

    sys.path.insert(0, str(MODELS.parent / "tools"))
    from tiny_classifier import LABELS, examples

    rows = examples(6, seed=11)
    texts = [t for t, _ in rows]
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"text": [*texts, "   "], "truth": [LABELS[y] for _, y in rows] + [None]},
    )
    spec = _spec(tmp_path, "classify", {"prompt_column": "text"}, target="classifier")
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    table = sorted(
        read_output(tmp_path / "out").to_pylist(), key=lambda r: int(r["request_id"].split("/")[1])
    )
    assert table[-1]["error"] == "empty prompt"
    good = table[:-1]
    want = shared_engines.engine(spec).llm.classify(texts, use_tqdm=False)
    for got, ref in zip(good, want, strict=True):
        assert np.allclose(got["probs"], ref.outputs.probs, atol=1e-5)
        assert math.isclose(sum(got["probs"]), 1.0, abs_tol=1e-4)
    assert [r["label"] for r in good] == [r["truth"] for r in good]  # the tiny task is learned


def test_score_is_vllms_cosine_of_the_pairs_embeddings(tmp_path, shared_engines):
    queries = [TEXTS[0], TEXTS[2], TEXTS[3], TEXTS[5], TEXTS[1]]
    docs = [TEXTS[5], TEXTS[6], TEXTS[7], TEXTS[0], None]
    write_parquet(tmp_path / "in" / "a.parquet", {"query": queries, "document": docs, "k": list(range(5))})
    spec = _spec(tmp_path, "score", {"pair_columns": ["query", "document"]})
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    table = read_output(tmp_path / "out")
    assert table.column_names[:2] == ["request_id", "k"]  # the pair's texts are not kept
    rows = sorted(table.to_pylist(), key=lambda r: r["k"])
    llm = shared_engines.engine(
        build_spec({**spec.raw, "task": "embed", "input": {"path": "unused", "prompt_column": "p"}})
    ).llm
    for row, q, d in zip(rows[:4], queries, docs, strict=False):
        (want,) = llm.score(q, d, use_tqdm=False)
        assert row["error"] is None and math.isclose(row["score"], want.outputs.score, abs_tol=1e-5)
        assert row["num_prompt_tokens"] > 0
    assert rows[4]["error"] == "null pair text in 'document'" and rows[4]["score"] is None


def test_a_cross_encoder_scores_as_vllms_own_with_each_side_from_its_template(tmp_path, shared_engines):
    """``task: score`` with the tiny cross-encoder (`make models`): both texts in one request,
    each rendered from the row's columns by its own template; the scores are those of vLLM's
    ``LLM.score`` on the same engine for the rendered texts, bad rows are error rows, and a job
    of two columns runs on the same engine, a duplicate pair scored once."""
    import sys

    sys.path.insert(0, str(MODELS.parent / "tools"))
    from tiny_cross_encoder import pairs

    good = pairs(3, seed=23)  # (query, document, relevant): 18 pairs
    n = len(good)
    langs = [f" {q} " for q, _, _ in good] + ["python", "  ", "json"]
    bodies = [d for _, d, _ in good] + [None, TEXTS[0], TOO_LONG]
    notes = ["from the stdlib"] + [None] * (len(langs) - 1)
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"lang": langs, "body": bodies, "note": notes, "k": list(range(len(langs)))},
    )
    templates = ["{{ lang | trim }}", "{{ body }}{% if note is defined %}\n# {{ note }}{% endif %}"]
    spec = _spec(tmp_path, "score", {"pair_templates": templates}, target="cross-encoder")
    assert spec.cross_encoder and spec.dimensions is None
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    table = read_output(tmp_path / "out")
    assert {"lang", "body", "note"} <= set(table.column_names)  # read by the templates: kept
    rows = sorted(table.to_pylist(), key=lambda r: r["k"])
    assert len(rows) == len(langs)
    queries = [q.strip() for q in langs[:n]]
    docs = [d + (f"\n# {notes[i]}" if notes[i] else "") for i, d in enumerate(bodies[:n])]
    llm = shared_engines.engine(spec).llm
    want = llm.score(queries, docs, use_tqdm=False)
    for row, ref in zip(rows, want, strict=False):
        assert row["error"] is None and row["finish_reason"] == "stop", row
        assert math.isclose(row["score"], ref.outputs.score, abs_tol=1e-5), (row["k"], ref.outputs.score)
        assert 0.0 < row["score"] < 1.0  # vLLM's activation for one label: a sigmoid
        assert row["num_prompt_tokens"] == len(ref.prompt_token_ids)
    # what the tiny model learned: Python code asked for as such scores over any other document
    python = {d for _, d, y in good if y}
    relevant = [r["score"] for r, (_, _, y) in zip(rows, good, strict=False) if y]
    other = [r["score"] for r, (_, d, _) in zip(rows, good, strict=False) if d not in python]
    assert relevant and other and min(relevant) > max(other), (relevant, other)
    errors = {r["k"]: r["error"] for r in rows[n:]}
    assert errors == {
        n: "null cell in column 'body': the template gives it no default",
        n + 1: "empty pair text: input.pair_templates[0] renders only whitespace",
        n + 2: errors[n + 2],
    }
    assert errors[n + 2].startswith("prompt too long: ") and "max_model_len 512" in errors[n + 2]

    # the same engine scores two columns as they are, and a duplicate pair once
    columns = tmp_path / "columns"
    write_parquet(columns / "in" / "a.parquet", {"q": ["python", "json", "python"], "d": [TEXTS[0]] * 3})
    spec = _spec(columns, "score", {"pair_columns": ["q", "d"]}, target="cross-encoder")
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    rows = {r["request_id"]: r for r in read_output(columns / "out").to_pylist()}
    first, second = llm.score(["python", "json"], [TEXTS[0], TEXTS[0]], use_tqdm=False)
    assert math.isclose(rows["a/0"]["score"], first.outputs.score, abs_tol=1e-5)
    assert math.isclose(rows["a/1"]["score"], second.outputs.score, abs_tol=1e-5)
    assert rows["a/2"]["twin_of"] == "a/0" and rows["a/2"]["score"] == rows["a/0"]["score"]


#: Each task's job for the kill tests: its keys, the result column compared across shards.
KILLED = {
    "embed": ({"prompt_column": "text"}, "target", "embedding"),
    "classify": ({"prompt_column": "text"}, "classifier", "probs"),
    # a reranker's job: the cross-encoder (the bi-encoder's cosine is checked on the shared engine)
    "score": ({"pair_columns": ["text", "other"]}, "cross-encoder", "score"),
}
#: Shards of the kill tests' jobs, 40 rows each.
KILLED_SHARDS = 10


@pytest.mark.parametrize("task", ["embed", "classify", "score"])
def test_a_pooling_job_killed_and_rerun_holds_every_row_once(tmp_path, task):
    """SIGKILL after the first commit, then a rerun: every row once, and each shard's results equal
    to those of the shard the killed run committed (the shards hold the same texts). A shard takes
    a fraction of a second, so there are ten: once three shards were all committed before the kill
    landed. The
    embedding job runs as a production run does, vLLM's own processes killed with it, and is
    rerun under ``--executor ray``; the others run their engine in batchspec's process and are
    rerun locally."""
    keys, target, column = KILLED[task]
    for s in range(KILLED_SHARDS):
        texts = [f"{TEXTS[i % 8]} # {i}" for i in range(40)]
        write_parquet(
            tmp_path / "in" / f"s{s}.parquet",
            {"id": [f"s{s}-{i}" for i in range(40)], "text": texts, "other": texts[::-1]},
        )
    job = write_job(
        tmp_path / "job.yaml",
        task=task,
        input={"path": str(tmp_path / "in" / "*.parquet"), "id_column": "id", **keys},
        output={"path": str(tmp_path / "out")},
        model={"target": str(MODELS / target), "engine": dict(ENGINE)},
        execution={"max_in_flight": 4},
        executor={"replicas": 1, "resources_per_replica": {"CPU": 1}},
    )
    ray = task == "embed"
    killed = Job(job, env=None if ray else INLINE_ENGINE)
    first = killed.wait_for("shard_committed")
    assert first is not None, killed.stderr
    killed.kill_group()
    killed.wait()
    assert len(list((tmp_path / "out").glob("*.parquet"))) < KILLED_SHARDS
    extra = ["--executor", "ray"] if ray else []
    rerun = run_cli("run", str(job), "--no-progress", "--log-format", "json", *extra, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    events = [json.loads(line) for line in rerun.stderr.splitlines() if line.startswith("{")]
    assert first["shard"] in [e["shard"] for e in events if e["event"] == "shard_skipped"]
    table = read_output(tmp_path / "out")
    ids = table["request_id"].to_pylist()
    assert sorted(ids) == sorted(f"s{s}-{i}" for s in range(KILLED_SHARDS) for i in range(40))
    assert table["error"].null_count == len(ids)
    values = dict(zip(ids, table[column].to_pylist(), strict=True))
    for s in range(KILLED_SHARDS):
        for i in range(40):
            assert np.allclose(values[f"s{s}-{i}"], values[f"{first['shard']}-{i}"], atol=1e-5), (s, i)


def test_openai_batch_embedding_lines_are_answered_in_openais_shape(tmp_path, shared_engines):
    import base64

    from openai.types import CreateEmbeddingResponse

    lines = [
        {"custom_id": "a", "body": {"model": "tiny", "input": TEXTS[0]}},
        {"custom_id": "b", "body": {"model": "tiny", "input": TEXTS[2], "encoding_format": "base64"}},
        {"custom_id": "c", "body": {"model": "tiny", "input": TEXTS[3], "dimensions": 256, "user": "u1"}},
        {"custom_id": "d", "body": {"model": "tiny", "input": [TEXTS[0], TEXTS[1]]}},
        {"custom_id": "e", "body": {"model": "tiny", "input": TEXTS[0], "dimensions": 64}},
        {"custom_id": "f", "body": {"model": "tiny", "input": "  "}},
        {"custom_id": "g", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": []}},
        {"custom_id": "h", "body": {"model": "tiny", "input": TEXTS[1], "temperature": 0.5}},
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "requests.jsonl").write_text(
        "".join(json.dumps({"method": "POST", "url": "/v1/embeddings", **line}) + "\n" for line in lines)
    )
    spec = build_spec(
        {
            "task": "embed",
            "input": {"path": str(tmp_path / "in" / "requests.jsonl"), "format": "openai"},
            "output": {"path": str(tmp_path / "out"), "format": "openai"},
            "model": {"target": str(MODELS / "target"), "engine": {**ENGINE, "served_model_name": "tiny"}},
        }
    )
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log[-3000:]
    results = {}
    for raw in (tmp_path / "out" / "requests.output.jsonl").read_text().splitlines():
        line = json.loads(raw)
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        for item in body["data"]:
            if isinstance(item["embedding"], str):  # base64, which the openai client decodes so
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
        results[line["custom_id"]] = CreateEmbeddingResponse.model_validate(body)
    assert sorted(results) == ["a", "b", "c"]
    llm = shared_engines.engine(spec).llm
    want = llm.embed([TEXTS[0], TEXTS[2], TEXTS[3]], use_tqdm=False)
    for key, ref in zip("abc", want, strict=True):
        assert np.allclose(results[key].data[0].embedding, ref.outputs.embedding, atol=1e-5), key
    assert (
        results["a"].usage.prompt_tokens == len(want[0].prompt_token_ids) == results["a"].usage.total_tokens
    )
    assert results["a"].model == "tiny" and results["a"].data[0].index == 0
    errors = {}
    for raw in (tmp_path / "out" / "requests.errors.jsonl").read_text().splitlines():
        line = json.loads(raw)
        errors[line["custom_id"]] = line["response"]["body"]["error"]["message"]
    assert sorted(errors) == ["d", "e", "f", "g", "h"]
    assert "body.input is a list" in errors["d"] and "64" in errors["e"] and "empty prompt" in errors["f"]
    assert "/v1/chat/completions" in errors["g"] and "body.temperature" in errors["h"]
    report = run_cli_in_process("report", str(tmp_path / "out"), "--format", "json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["overall"]["rows"] == 8
