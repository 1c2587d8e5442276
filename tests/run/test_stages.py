"""The run's stages (batchspec.run.stages) called one by one, as an executor calls them, without
run_job: plan shards, check inputs, then claim, read, generate, write and commit through a
:class:`ShardPipeline`, then summarise. The fake engine echoes prompts (tests/helpers/fakes.py); the
same stages run on the real engine in test_e2e.py (local) and test_ray.py (Ray replicas)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.errors import InputDataError
from batchspec.io.records import Shard
from batchspec.leases.shard_leases import ShardLeases
from batchspec.run.events import EventLog, Progress
from batchspec.run.outcome import RunOutcome, summarise
from batchspec.run.stages import ShardPipeline, ShardRun, ShardState, check_inputs, plan
from batchspec.spec.build import build_spec


def _spec(tmp_path):
    return build_spec(
        {
            "name": "stages",
            "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
            "output": {"path": str(tmp_path / "out")},
            "model": {"target": "unused"},
            "sampling": {"temperature": 0.0, "max_tokens": 8},
            "execution": {"max_in_flight": 3},
        }
    )


def _pipeline(spec, p, leases, counts, bad_shard) -> tuple[ShardPipeline, list]:
    """A pipeline for run r1 with a fresh outcome and progress; the events it emits."""
    events = EventLog("r1", "json")
    seen: list[tuple[str, dict]] = []
    events.emit = lambda event, message="", level="info", **f: seen.append((event, f))
    progress = Progress(events, sum(counts.values()), len(counts), bars=False)
    pipeline = ShardPipeline(
        spec,
        "r1",
        p.out,
        leases,
        events,
        progress,
        RunOutcome(),
        p.spec_fingerprint,
        None,
        overwrite=False,
        stop=lambda: False,
        grace_s=0.0,
        bad_shard=bad_shard,
    )
    return pipeline, seen


def test_stages_one_by_one(tmp_path):
    for i in range(3):
        write_parquet(tmp_path / "in" / f"s{i}.parquet", {"prompt": [f"prompt {i}-{j}" for j in range(5)]})
    write_parquet(tmp_path / "in" / "bad.parquet", {"text": ["no prompt column"]})
    spec = _spec(tmp_path)

    p = plan(spec)  # 1. plan shards
    assert sorted(p.states.items()) == [
        ("bad", "pending"),
        ("s0", "pending"),
        ("s1", "pending"),
        ("s2", "pending"),
    ]
    bad: list[str] = []

    def bad_shard(shard, exc: InputDataError) -> None:
        bad.append(shard.name)

    shards, counts = check_inputs(spec, p.shards, bad_shard)  # 2. check inputs
    assert bad == ["bad"] and counts == {"s0": 5, "s1": 5, "s2": 5}

    # another run holds s1's lease: the claim stage leaves it alone
    other = ShardLeases(p.out, {"run_id": "other", "host": "h", "pid": 1}, 60)
    assert other.acquire("s1") is None
    leases = ShardLeases(p.out, {"run_id": "r1", "host": "h", "pid": 2}, 60)
    pipeline, seen = _pipeline(spec, p, leases, counts, bad_shard)
    progress, outcome = pipeline.progress, pipeline.outcome
    with leases:
        pipeline.generate(FakeEngine(), shards, counts)  # 3. claim, read, generate, commit
    other.release("s1")

    assert sorted(outcome.committed) == ["s0", "s2"]
    assert list(outcome.busy) == ["s1"] and "other" in outcome.busy["s1"]
    assert {r.shard.name: r.state for r in pipeline.runs} == {
        "s0": ShardState.COMMITTED,
        "s1": ShardState.BUSY,
        "s2": ShardState.COMMITTED,
    }
    assert sorted(f["shard"] for e, f in seen if e == "shard_committed") == ["s0", "s2"]
    for name in ("s0", "s2"):
        table = pq.read_table(tmp_path / "out" / f"{name}.parquet")
        assert table["generated_text"].to_pylist() and table.num_rows == 5
        manifest = json.loads((tmp_path / "out" / "_batchspec" / "manifest" / f"{name}.json").read_text())
        assert manifest["rows"] == 5 and manifest["run_id"] == "r1"
    assert not (tmp_path / "out" / "s1.parquet").exists()
    assert progress.rows == 10 and progress.total_rows == 10  # s1's rows dropped from the total
    assert plan(spec).states["s0"] == "committed" and plan(spec).states["s1"] == "pending"

    summary = summarise({}, outcome, wall_s=2.0, generation_wall_s=1.0, per_position=None)  # 4. summarise
    assert summary["totals"]["rows"] == 10 and summary["totals"]["shards_committed"] == 2
    assert summary["totals"]["generation_output_tokens_per_s"] == pytest.approx(
        summary["totals"]["output_tokens"] / 1.0
    )


class _Leases(ShardLeases):
    """Real leases on local disk, but s1's renewal thread 'loses' its lease and s2's
    re-check before commit finds it taken over."""

    def lost(self, shard_name):
        return shard_name == "s1" or super().lost(shard_name)

    def confirm(self, shard_name):
        return shard_name != "s2" and super().confirm(shard_name)


def test_a_shard_whose_lease_goes_is_abandoned_never_committed(tmp_path):
    for i in range(3):
        write_parquet(tmp_path / "in" / f"s{i}.parquet", {"prompt": [f"prompt {i}-{j}" for j in range(5)]})
    spec = _spec(tmp_path)
    p = plan(spec)
    leases = _Leases(p.out, {"run_id": "r1", "host": "h", "pid": 2}, 60)
    counts = {"s0": 5, "s1": 5, "s2": 5}
    pipeline, seen = _pipeline(spec, p, leases, counts, bad_shard=None)
    progress, outcome = pipeline.progress, pipeline.outcome
    with leases:
        pipeline.generate(FakeEngine(), p.shards, counts)

    states = {r.shard.name: r.state for r in pipeline.runs}
    assert states == {"s0": ShardState.COMMITTED, "s1": ShardState.ABANDONED, "s2": ShardState.ABANDONED}
    assert list(outcome.committed) == ["s0"]
    assert outcome.lost["s1"].startswith("lost its lease")
    assert outcome.lost["s2"].startswith("taken over by another run before commit")
    assert [f["shard"] for e, f in seen if e == "shard_conflict"] == ["s1", "s2"]
    assert sorted(x.name for x in (tmp_path / "out").glob("*.parquet")) == ["s0.parquet"]
    assert not list((tmp_path / "out" / "_batchspec" / "tmp").glob("*"))  # copies discarded
    # s1 went before any of its results was written: its 5 rows left the total; s2's were done
    assert progress.total_rows == 10 and progress.rows == 10


def test_a_shard_moves_only_forward():
    shard = Shard(url="file:///in/s.parquet", path="/in/s.parquet", name="s", fs=None, fingerprint={})
    run = ShardRun(shard)
    with pytest.raises(RuntimeError, match="no move from pending to committed"):
        run.move(ShardState.COMMITTED)
    for state in (ShardState.READING, ShardState.READ, ShardState.COMMITTED):
        run.move(state)
    assert not run.holds_lease and not run.dropped
    with pytest.raises(RuntimeError, match="no move from committed to abandoned"):
        run.move(ShardState.ABANDONED)
