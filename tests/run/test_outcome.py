"""The run's outcome (batchspec.run.outcome.RunOutcome): what a replica hands the Ray driver and
what the summary JSON shows of it; and RunContext.bad_shard, the one place a run decides to skip
an unreadable shard or end."""

from __future__ import annotations

import json
import pickle

import pytest
from helpers.fake_runs import make_spec, run, shards

from batchspec.errors import InputDataError
from batchspec.io.records import Shard
from batchspec.run.events import EventLog
from batchspec.run.executors.base import RunContext
from batchspec.run.outcome import RunOutcome, ShardStats

#: The run summary's keys for a local run that ends ok.
SUMMARY_KEYS = {
    "run_id",
    "job",
    "spec",
    "versions",
    "worker",
    "started_at",
    "shards",
    "bad_shards",
    "busy_shards",
    "lost_shards",
    "spec_fingerprint",
    "engine",
    "status",
    "totals",
    "exit_code",
    "ended_at",
}


def _stats(rows: int) -> dict:
    stats = ShardStats()
    for _ in range(rows):
        stats.add({"num_output_tokens": 2})
    return stats.as_dict(1.0)


def test_a_replicas_outcome_crosses_as_data_and_merges_what_it_settled():
    replica = RunOutcome(
        committed={"s0": _stats(3)},
        bad={"s1": "s1: unreadable"},
        busy={"s2": "run r on h pid 1"},
        lost={"s3": "lost its lease: run x"},
    )
    replica = pickle.loads(pickle.dumps(replica))  # as Ray hands it back
    driver = RunOutcome(committed={"a": _stats(1)})
    driver.merge_settled(replica)
    assert sorted(driver.committed) == ["a", "s0"] and driver.committed["s0"]["rows"] == 3
    assert driver.bad == {"s1": "s1: unreadable"} and driver.lost == replica.lost
    assert driver.busy == {}  # the driver's lease wait decides about busy shards


def test_summary_sections_and_totals():
    outcome = RunOutcome(committed={"s0": _stats(3), "s1": _stats(2)})
    assert list(outcome.summary_sections()) == ["shards", "bad_shards", "busy_shards", "lost_shards"]
    outcome.failed["s2"] = "no Ray replica left to run it"
    outcome.executor = {"kind": "ray", "replica_deaths": []}
    sections = outcome.summary_sections()
    assert sections["failed_shards"] == outcome.failed and sections["executor"]["kind"] == "ray"
    totals = outcome.totals(wall_s=2.0, generation_wall_s=1.0)
    assert (totals["rows"], totals["output_tokens"], totals["shards_committed"]) == (5, 10, 2)
    assert totals["generation_output_tokens_per_s"] == 10.0


def test_incomplete_names_busy_then_lost_then_failed_shards():
    assert RunOutcome(committed={"s0": _stats(1)}).incomplete() is None
    outcome = RunOutcome(failed={"s2": "died"}, lost={"s1": "lost its lease: run x"})
    assert "1 shards lost their lease" in str(outcome.incomplete())
    outcome.busy["s0"] = "run r on h pid 1"
    err = outcome.incomplete()
    assert err.exit_code == 1 and str(err) == (
        "1 shards are being processed by another run and were left alone: s0 (run r on h pid 1)"
    )


@pytest.mark.vllm
def test_the_summary_file_keeps_its_keys(tmp_path):
    shards(tmp_path, n=2, rows=3)
    (tmp_path / "in" / "s9.parquet").write_bytes(b"garbage")
    result, _ = run(make_spec(tmp_path, on_bad_shard="skip"))
    written = json.loads(open(result.summary_path).read())
    assert set(written) == SUMMARY_KEYS
    assert sorted(written["shards"]) == ["s0", "s1"] and list(written["bad_shards"]) == ["s9"]
    assert written["busy_shards"] == {} and written["lost_shards"] == {}
    assert written == json.loads(json.dumps(result.summary))


def _context(tmp_path, on_bad_shard: str) -> tuple[RunContext, list]:
    seen: list = []
    events = EventLog("r", "json")
    events.emit = lambda event, message="", level="info", **f: seen.append((event, level, f))
    spec = make_spec(tmp_path, on_bad_shard=on_bad_shard)
    ctx = RunContext(
        spec=spec,
        run_id="r",
        out=None,
        owner={},
        events=events,
        stop=None,
        overwrite=False,
        grace_s=0.0,
        new_progress=None,
    )
    return ctx, seen


def test_bad_shard_skips_into_the_outcome_or_raises(tmp_path):
    shard = Shard(url="file:///in/s1.parquet", path="/in/s1.parquet", name="s1", fs=None, fingerprint={})
    exc = InputDataError("s1.parquet", "not a readable Parquet file")
    ctx, seen = _context(tmp_path, "skip")
    ctx.bad_shard(shard, exc)
    assert ctx.outcome.bad == {"s1": str(exc)}
    assert seen == [("shard_failed", "warning", {"shard": "s1"})]

    ctx, seen = _context(tmp_path, "fail")
    with pytest.raises(InputDataError):
        ctx.bad_shard(shard, exc)
    assert ctx.outcome.bad == {} and seen == [("shard_failed", "error", {"shard": "s1"})]
