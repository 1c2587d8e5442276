"""Identical requests generated once (batchspec/run/twins.py, ``execution.dedupe_window``): on
the fake engine, which counts what it is sent. Each twin's row is written with the generated
row's text and ``twin_of`` naming it, every row exactly once across shards; sampled rows without
a seed, refused rows and ``dedupe_window: 0`` are generated as they are; what waits is bounded.
And one run on the real engine, against the same job with every row generated."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import make_spec, run
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.io.rows import Row
from batchspec.run.twins import NOT_COPIED, Twins, request_key
from batchspec.spec.build import build_spec


class CountingEngine(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent: list[str] = []

    def stream(self, rows, *args, **kwargs):
        def counted():
            for row in rows:
                self.sent.append(row.request_id)
                yield row

        yield from super().stream(counted(), *args, **kwargs)


def _shards(tmp_path, prompts_per_shard):
    for i, prompts in enumerate(prompts_per_shard):
        write_parquet(tmp_path / "in" / f"s{i}.parquet",
                      {"prompt": prompts, "id": [f"s{i}-{j}" for j in range(len(prompts))]})


def _rows(tmp_path):
    return {r["request_id"]: r for p in sorted((tmp_path / "out").glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()}


def test_identical_greedy_requests_are_generated_once_and_written_to_each_row(tmp_path):
    _shards(tmp_path, [["a", "b", "a", "c", "a"], ["b", "d", "a", "", "a"]])
    spec = make_spec(tmp_path, id_column="id")
    engine = CountingEngine(seed=2)
    result, _ = run(spec, engine=engine)
    rows = _rows(tmp_path)
    assert len(rows) == 10  # every row, once
    sent = set(engine.sent)
    # one request per distinct prompt; the empty prompt is an error row, never a twin
    assert len(engine.sent) == 5 and len(sent) == 5
    by_prompt = {}
    for r in rows.values():
        if r["error"] is None:
            by_prompt.setdefault(r["generated_text"], []).append(r)
    for text, group in by_prompt.items():
        generated = [r for r in group if r["twin_of"] is None]
        assert len(generated) == 1 and generated[0]["request_id"] in sent, text
        for twin in group:
            if twin["twin_of"] is not None:
                assert twin["twin_of"] == generated[0]["request_id"]
                assert all(twin[c] is None for c in NOT_COPIED)
                assert twin["num_output_tokens"] == generated[0]["num_output_tokens"]
    assert result.summary["totals"]["rows_from_twin"] == 5
    assert sum(s["rows_from_twin"] for s in result.summary["shards"].values()) == 5


def test_sampled_rows_without_a_seed_and_a_window_of_0_are_all_generated(tmp_path):
    _shards(tmp_path, [["a", "a", "a"]])
    sampled = build_spec({**_raw(tmp_path), "sampling": {"temperature": 0.8, "max_tokens": 8}})
    engine = CountingEngine()
    run(sampled, engine=engine)
    assert len(engine.sent) == 3 and all(r["twin_of"] is None for r in _rows(tmp_path).values())
    seeded = build_spec({**_raw(tmp_path), "output": {"path": str(tmp_path / "out2")},
                         "sampling": {"temperature": 0.8, "seed": 3, "max_tokens": 8}})
    engine = CountingEngine()
    run(seeded, engine=engine)
    assert len(engine.sent) == 1
    off = build_spec({**_raw(tmp_path), "output": {"path": str(tmp_path / "out3")},
                      "execution": {"dedupe_window": 0}})
    engine = CountingEngine()
    run(off, engine=engine)
    assert len(engine.sent) == 3


def _raw(tmp_path):
    return {"name": "twins", "input": {"path": str(tmp_path / "in" / "*.parquet"),
                                       "prompt_column": "prompt", "id_column": "id"},
            "output": {"path": str(tmp_path / "out")}, "model": {"target": "unused"},
            "sampling": {"temperature": 0.0, "max_tokens": 8}}


def test_per_row_sampling_and_adapters_are_part_of_what_is_identical():
    base = {"temperature": 0.0}
    same = [Row("s", i, f"r{i}", {}, prompt="p") for i in range(2)]
    assert request_key(same[0], base) == request_key(same[1], base) is not None
    longer = Row("s", 2, "r2", {}, prompt="p", overrides={"max_tokens": 99})
    adapter = Row("s", 3, "r3", {}, prompt="p", lora="upper")
    chat = Row("s", 4, "r4", {}, messages=[{"role": "user", "content": "p"}])
    keys = {request_key(r, base) for r in (same[0], longer, adapter, chat)}
    assert len(keys) == 4
    assert request_key(Row("s", 5, "r5", {}, prompt="p", error="bad"), base) is None
    assert request_key(same[0], {}) is None  # temperature left to the model: maybe sampled
    assert request_key(same[0], {"temperature": 1.0, "seed": 1}) is not None


def test_what_waits_is_bounded():
    """At most ``hold`` rows wait (held back, or answered and not yet written): the rest are
    generated; results with logprobs are not kept for later twins."""
    twins = Twins({"temperature": 0.0}, window=100, hold=2)
    rows = [Row("s", i, f"r{i}", {}, prompt="same") for i in range(6)]
    sent = list(twins.primaries(iter(rows)))
    # the first is generated, two wait for it, the rest are generated as they are
    assert [r.request_id for r in sent] == ["r0", "r3", "r4", "r5"]
    served = twins.finished(rows[0], [{"generated_text": "x", "error": None}])
    assert [t.request_id for t, _ in served] == ["r1", "r2"]
    assert all(res[0]["twin_of"] == "r0" for _, res in served)
    # after it finished, later twins are answered at once, and at most `hold` wait to be written
    more = [Row("s", i, f"r{i}", {}, prompt="same") for i in range(6, 10)]
    sent = list(twins.primaries(iter(more)))
    # r6 and r7 fill what may wait; r8 and r9 are generated
    assert [r.request_id for r in sent] == ["r8", "r9"]
    served = twins.finished(sent[0], [{"generated_text": "x", "error": None}])
    assert [(t.request_id, res[0]["twin_of"]) for t, res in served] == [("r6", "r0"), ("r7", "r0")]
    assert twins.ready() == []
    # a result with logprobs is not kept: a later twin is generated
    lp = Twins({"temperature": 0.0}, window=100, hold=8)
    first, later = (Row("s", i, f"l{i}", {}, prompt="q", overrides={"logprobs": 1})
                    for i in range(2))
    assert list(lp.primaries(iter([first]))) == [first]
    lp.finished(first, [{"generated_text": "x", "error": None, "token_logprobs": [-0.1]}])
    assert list(lp.primaries(iter([later]))) == [later]


@pytest.mark.engine
def test_twins_on_the_real_engine_get_the_text_generating_them_would_give(tmp_path,
                                                                          shared_engines):
    """Greedy rows repeating across two shards, on the real engine with a draft: the engine is
    sent each distinct request once, each twin's text is the generated row's, and a job with
    ``dedupe_window: 0`` (every row generated) writes the same texts."""
    from helpers.jobs import DRAFT, ENGINE, MODELS, read_output

    prompts = ["def mean(xs):", "import os\n", "class Point:", "def mean(xs):"]
    _shards(tmp_path, [prompts, ["import os\n", "for i in range(", "def mean(xs):"]])
    raw = {**_raw(tmp_path), "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)},
           "speculative": dict(DRAFT), "sampling": {"temperature": 0.0, "max_tokens": 12}}
    run_ = shared_engines.run(build_spec(raw))
    assert run_.exit_code == 0, run_.log[-3000:]
    rows = {r["request_id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert len(rows) == 7
    twins = {rid: r for rid, r in rows.items() if r["twin_of"] is not None}
    assert sorted(twins) == ["s0-3", "s1-0", "s1-2"]
    for rid, twin in twins.items():
        generated = rows[twin["twin_of"]]
        assert generated["twin_of"] is None and generated["spec_num_draft_tokens"] > 0
        assert twin["generated_text"] == generated["generated_text"], rid
        assert twin["spec_num_draft_tokens"] is None and twin["time_e2e_s"] is None
    assert run_.summary["totals"]["rows_from_twin"] == 3
    every = shared_engines.run(build_spec({**raw, "output": {"path": str(tmp_path / "every")},
                                           "execution": {"dedupe_window": 0}}))
    assert every.exit_code == 0, every.log[-3000:]
    again = {r["request_id"]: r for r in read_output(tmp_path / "every").to_pylist()}
    assert all(r["twin_of"] is None for r in again.values())
    assert {k: r["generated_text"] for k, r in again.items()} == \
        {k: r["generated_text"] for k, r in rows.items()}
