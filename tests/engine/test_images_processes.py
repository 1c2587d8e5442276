"""Image jobs in `batchspec` processes of their own (tests/engine/test_images.py has the rest, on
shared engines), so `make test` runs them beside the shared-engine group (tests/helpers/lanes.py):
a job killed and rerun on Ray, and `batchspec tune` weighing a draft model and n-gram on one."""

from __future__ import annotations

import json
import random

import pytest
from helpers.jobs import INLINE_ENGINE, VLM_ENGINE, png_bytes, read_output, run_cli, write_job, write_parquet
from helpers.recovery import Job
from tiny_vlm import QUESTIONS, picture  # tools/ is on the path (conftest.py)

pytestmark = pytest.mark.engine

SHARDS, ROWS = 6, 8


def test_an_image_job_killed_then_rerun_on_ray_has_every_row_once(tmp_path, models):
    """SIGKILL after the first commit, then a rerun under ``--executor ray``: every row once,
    and rows of the same picture and question give one text whichever run wrote them (each shard
    holds the same rows, pictures by bytes in one column and by path in another)."""
    rng = random.Random(5)
    pics = tmp_path / "pics"
    pics.mkdir()
    shown = []
    for i in range(ROWS):
        image, truth = picture(rng)
        (pics / f"p{i}.png").write_bytes(png_bytes(image))
        shown.append((png_bytes(image), QUESTIONS["shape"][0]))
    for s in range(SHARDS):
        write_parquet(
            tmp_path / "in" / f"s{s}.parquet",
            {
                "id": [f"s{s}-{i}" for i in range(ROWS)],
                "question": [q for _, q in shown],
                "img": [data for data, _ in shown],
                "url": [str(pics / f"p{i}.png") for i in range(ROWS)],
            },
        )
    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "id_column": "id",
            "prompt_column": "question",
            "image_columns": ["img", "url"],
            "image_roots": [str(pics)],
        },
        output={"path": str(tmp_path / "out")},
        model={"target": str(models / "vlm"), "engine": VLM_ENGINE},
        sampling={"temperature": 0.0, "max_tokens": 6},
        execution={"max_in_flight": 2},
        executor={"replicas": 1, "resources_per_replica": {"CPU": 1}},
    )
    killed = Job(job, env=INLINE_ENGINE)
    first = killed.wait_for("shard_committed")
    assert first is not None, killed.stderr
    killed.kill_group()
    killed.wait()
    assert len(list((tmp_path / "out").glob("*.parquet"))) < SHARDS
    rerun = run_cli(
        "run", str(job), "--no-progress", "--log-format", "json", "--executor", "ray", timeout=900
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    events = [json.loads(line) for line in rerun.stderr.splitlines() if line.startswith("{")]
    assert first["shard"] in [e["shard"] for e in events if e["event"] == "shard_skipped"]
    table = read_output(tmp_path / "out")
    ids = table["request_id"].to_pylist()
    assert sorted(ids) == sorted(f"s{s}-{i}" for s in range(SHARDS) for i in range(ROWS))
    assert table["error"].null_count == len(ids), table["error"].to_pylist()
    text = dict(zip(ids, table["generated_text"].to_pylist(), strict=True))
    for s in range(SHARDS):
        for i in range(ROWS):
            assert text[f"s{s}-{i}"] == text[f"{first['shard']}-{i}"], (s, i)
    assert len({text[f"s0-{i}"] for i in range(ROWS)}) > 1  # the answers follow the pictures


def _drafted_job(tmp_path, models, speculative=None):
    """Eight image rows on the VLM, its image token given for vLLM's drafter (docs/images.md)."""
    rng = random.Random(8)
    rows = [picture(rng)[0] for _ in range(8)]
    write_parquet(
        tmp_path / "in" / "rows.parquet",
        {
            "id": [f"r{i}" for i in range(len(rows))],
            "question": [QUESTIONS["shape"][0]] * len(rows),
            "img": [png_bytes(image) for image in rows],
        },
    )
    engine = {**VLM_ENGINE, "hf_overrides": {"image_token_index": 2051}}
    return write_job(
        tmp_path / "job.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "id_column": "id",
            "prompt_column": "question",
            "image_columns": ["img"],
        },
        output={"path": str(tmp_path / "out")},
        model={"target": str(models / "vlm"), "engine": engine},
        speculative=speculative,
        sampling={"temperature": 0.0, "max_tokens": 6},
    )


def test_tune_measures_a_draft_model_and_ngram_on_an_image_job(tmp_path, models):
    """The VLM's draft (its language model's first layer, given the target's image token by
    ``hf_overrides``) and n-gram are measured on image rows: lossless, each with a speed-up."""
    job = _drafted_job(tmp_path, models)
    result = run_cli(
        "tune",
        str(job),
        "--sample",
        "8",
        "--concurrency",
        "4",
        "--k",
        "2",
        "--no-batch-knobs",
        "--draft",
        str(models / "vlm-draft"),
        "--json",
        env=INLINE_ENGINE,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    labels = {c["label"]: c for c in data["candidates"]}
    assert {"off", "vlm-draft k=2", "ngram k=2"} <= set(labels), sorted(labels)
    for label in ("vlm-draft k=2", "ngram k=2"):
        entry = labels[label]
        assert entry["skipped"] is None and entry["lossless"] is True, entry
        assert entry["output_tokens_per_s"] > 0, entry
    assert labels["vlm-draft k=2"]["acceptance_rate"] > 0  # the draft proposed, and some was kept
    assert data["sample"]["rows"] == 8


def test_auto_measures_on_image_rows_and_runs_its_choice(tmp_path, models):
    """``speculative: auto`` on an image job: its sample's images reach the measuring engine,
    the draft model is among what it measured, and the run generates every row with its choice."""
    auto = {
        "method": "auto",
        "drafts": [str(models / "vlm-draft")],
        "k": [2],
        "sample": 8,
        "concurrency": [4],
    }
    job = _drafted_job(tmp_path, models, auto)
    result = run_cli("run", str(job), "--no-progress", env=INLINE_ENGINE, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_batchspec" / "runs").glob("*.json")]
    chosen = summary["speculative_auto"]["chosen"]
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_batchspec" / "auto").glob("*.json")]
    measured = {c["label"] for c in record["measurements"]["candidates"]}
    assert {"off", "vlm-draft k=2"} <= measured and chosen in measured, (chosen, measured)
    table = read_output(tmp_path / "out")
    assert table.num_rows == 8 and table["error"].null_count == 8
    assert summary["totals"]["images"] == 8
