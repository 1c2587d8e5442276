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
from batchspec.leases.shard_leases import ShardLeases
from batchspec.run.events import EventLog, Progress
from batchspec.run.outcome import new_outcome, summarise
from batchspec.run.stages import ShardPipeline, check_inputs, plan
from batchspec.spec.build import build_spec


def _spec(tmp_path):
    return build_spec({
        "name": "stages",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 3},
    })


def test_stages_one_by_one(tmp_path):
    for i in range(3):
        write_parquet(tmp_path / "in" / f"s{i}.parquet",
                      {"prompt": [f"prompt {i}-{j}" for j in range(5)]})
    write_parquet(tmp_path / "in" / "bad.parquet", {"text": ["no prompt column"]})
    spec = _spec(tmp_path)

    p = plan(spec)  # 1. plan shards
    assert sorted(p.states.items()) == [("bad", "pending"), ("s0", "pending"),
                                        ("s1", "pending"), ("s2", "pending")]
    bad: list[str] = []

    def bad_shard(shard, exc: InputDataError) -> None:
        bad.append(shard.name)

    shards, counts = check_inputs(spec, p.shards, bad_shard)  # 2. check inputs
    assert bad == ["bad"] and counts == {"s0": 5, "s1": 5, "s2": 5}

    # another run holds s1's lease: the claim stage leaves it alone
    other = ShardLeases(p.out, {"run_id": "other", "host": "h", "pid": 1}, 60)
    assert other.acquire("s1") is None
    events = EventLog("r1", "json")
    seen: list[tuple[str, dict]] = []
    events.emit = lambda event, message="", level="info", **f: seen.append((event, f))
    progress = Progress(events, sum(counts.values()), len(shards), bars=False)
    outcome = new_outcome()
    leases = ShardLeases(p.out, {"run_id": "r1", "host": "h", "pid": 2}, 60)
    pipeline = ShardPipeline(spec, "r1", p.out, leases, events, progress, outcome,
                             p.spec_fingerprint, None, overwrite=False, stop=lambda: False,
                             grace_s=0.0, bad_shard=bad_shard)
    with leases:
        pipeline.generate(FakeEngine(), shards, counts)  # 3. claim, read, generate, commit
    other.release("s1")

    assert sorted(outcome["shards"]) == ["s0", "s2"]
    assert list(outcome["busy_shards"]) == ["s1"] and "other" in outcome["busy_shards"]["s1"]
    assert sorted(f["shard"] for e, f in seen if e == "shard_committed") == ["s0", "s2"]
    for name in ("s0", "s2"):
        table = pq.read_table(tmp_path / "out" / f"{name}.parquet")
        assert table["generated_text"].to_pylist() and table.num_rows == 5
        manifest = json.loads((tmp_path / "out" / "_batchspec" / "manifest" / f"{name}.json")
                              .read_text())
        assert manifest["rows"] == 5 and manifest["run_id"] == "r1"
    assert not (tmp_path / "out" / "s1.parquet").exists()
    assert progress.rows == 10 and progress.total_rows == 10  # s1's rows dropped from the total
    assert plan(spec).states["s0"] == "committed" and plan(spec).states["s1"] == "pending"

    summary = summarise({"shards": outcome["shards"]}, wall_s=2.0, generation_wall_s=1.0,
                        per_position=None)  # 4. summarise
    assert summary["totals"]["rows"] == 10 and summary["totals"]["shards_committed"] == 2
    assert summary["totals"]["generation_output_tokens_per_s"] == pytest.approx(
        summary["totals"]["output_tokens"] / 1.0)
