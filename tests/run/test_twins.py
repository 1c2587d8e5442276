"""Identical requests generated once (batchspec/run/twins.py, ``execution.dedupe_window``): on
the fake engine, which counts what it is sent. Each twin's row is written with the generated
row's text and ``twin_of`` naming it, every row exactly once across shards; sampled rows without
a seed, refused rows and ``dedupe_window: 0`` are generated as they are; what waits is bounded,
and what is kept too (``dedupe_max_bytes``); an error is never a twin's answer (a failed
request's twins are generated). And one run on the real engine, against the same job with every
row generated."""

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
        write_parquet(
            tmp_path / "in" / f"s{i}.parquet",
            {"prompt": prompts, "id": [f"s{i}-{j}" for j in range(len(prompts))]},
        )


def _rows(tmp_path):
    return {
        r["request_id"]: r
        for p in sorted((tmp_path / "out").glob("*.parquet"))
        for r in pq.read_table(p).to_pylist()
    }


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_sampled_rows_without_a_seed_and_a_window_of_0_are_all_generated(tmp_path):
    _shards(tmp_path, [["a", "a", "a"]])
    sampled = build_spec({**_raw(tmp_path), "sampling": {"temperature": 0.8, "max_tokens": 8}})
    engine = CountingEngine()
    run(sampled, engine=engine)
    assert len(engine.sent) == 3 and all(r["twin_of"] is None for r in _rows(tmp_path).values())
    seeded = build_spec(
        {
            **_raw(tmp_path),
            "output": {"path": str(tmp_path / "out2")},
            "sampling": {"temperature": 0.8, "seed": 3, "max_tokens": 8},
        }
    )
    engine = CountingEngine()
    run(seeded, engine=engine)
    assert len(engine.sent) == 1
    off = build_spec(
        {**_raw(tmp_path), "output": {"path": str(tmp_path / "out3")}, "execution": {"dedupe_window": 0}}
    )
    engine = CountingEngine()
    run(off, engine=engine)
    assert len(engine.sent) == 3


def _raw(tmp_path):
    return {
        "name": "twins",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


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
    first, later = (Row("s", i, f"l{i}", {}, prompt="q", overrides={"logprobs": 1}) for i in range(2))
    assert list(lp.primaries(iter([first]))) == [first]
    lp.finished(first, [{"generated_text": "x", "error": None, "token_logprobs": [-0.1]}])
    assert list(lp.primaries(iter([later]))) == [later]


@pytest.mark.engine
def test_twins_on_the_real_engine_get_the_text_generating_them_would_give(tmp_path, shared_engines):
    """Greedy rows repeating across two shards, on the real engine with a draft: the engine is
    sent each distinct request once, each twin's text is the generated row's, and a job with
    ``dedupe_window: 0`` (every row generated) writes the same texts."""
    from helpers.jobs import DRAFT, ENGINE, MODELS, read_output

    prompts = ["def mean(xs):", "import os\n", "class Point:", "def mean(xs):"]
    _shards(tmp_path, [prompts, ["import os\n", "for i in range(", "def mean(xs):"]])
    raw = {
        **_raw(tmp_path),
        "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        "speculative": dict(DRAFT),
        "sampling": {"temperature": 0.0, "max_tokens": 12},
    }
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
    every = shared_engines.run(
        build_spec({**raw, "output": {"path": str(tmp_path / "every")}, "execution": {"dedupe_window": 0}})
    )
    assert every.exit_code == 0, every.log[-3000:]
    again = {r["request_id"]: r for r in read_output(tmp_path / "every").to_pylist()}
    assert all(r["twin_of"] is None for r in again.values())
    assert {k: r["generated_text"] for k, r in again.items()} == {
        k: r["generated_text"] for k, r in rows.items()
    }


# --------------------------------------------------------------------------- the cache's bytes


class SamplingEngine(CountingEngine):
    """Answers each row with the job's ``sampling.n`` samples, as vLLM does."""

    def stream(self, rows, *args, **kwargs):
        n = self.bound[-1].sampling.get("n", 1)
        for row, results in super().stream(rows, *args, **kwargs):
            if results[0]["error"] is None:
                results = [
                    {
                        **results[0],
                        "sample_index": i,
                        "generated_text": f"{results[0]['generated_text']} #{i}",
                    }
                    for i in range(n)
                ]
            yield row, results


@pytest.mark.vllm
def test_the_cache_stays_within_dedupe_max_bytes_and_every_row_is_written_once(tmp_path, monkeypatch):
    """Seeded rows at n = 4 repeating in pairs over five prompts, with room in the cache for
    about two results: the estimated bytes kept never exceed ``dedupe_max_bytes``, a prompt
    whose result was evicted is generated again, and every row is written once with its n
    samples, ``twin_of`` exactly on the rows that were not generated."""
    import batchspec.run.stages
    from batchspec.columns import empty_result
    from batchspec.run.twins import Twins, result_bytes

    made = []

    class Watched(Twins):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.peak = 0
            made.append(self)

        def finished(self, row, results):
            served = super().finished(row, results)
            self.peak = max(self.peak, self.cached_bytes)
            return served

    monkeypatch.setattr(batchspec.run.stages, "Twins", Watched)
    prompts = [f"p{(i // 2) % 5}" for i in range(60)]
    _shards(tmp_path, [prompts[:30], prompts[30:]])
    one = result_bytes(
        [
            {
                **empty_result(),
                "generated_text": f"P0 #{i}",
                "sample_index": i,
                "finish_reason": "stop",
                "num_prompt_tokens": 2,
                "num_output_tokens": 2,
            }
            for i in range(4)
        ]
    )
    bound = 2 * one + one // 2  # room for two results of four samples
    spec = build_spec(
        {
            **_raw(tmp_path),
            "sampling": {"temperature": 0.8, "seed": 3, "n": 4},
            "execution": {"max_in_flight": 2, "prefix_window": 0, "dedupe_max_bytes": bound},
        }
    )
    assert spec.execution.dedupe_max_bytes == bound
    engine = SamplingEngine()
    result, _ = run(spec, engine=engine)
    [twins] = made
    assert twins.max_bytes == bound and 0 < twins.peak <= bound
    written = [r for p in sorted((tmp_path / "out").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    by_id: dict[str, list[dict]] = {}
    for r in written:
        by_id.setdefault(r["request_id"], []).append(r)
    assert sorted(by_id) == sorted(f"s{s}-{j}" for s in range(2) for j in range(30))
    assert all(sorted(r["sample_index"] for r in rs) == [0, 1, 2, 3] for rs in by_id.values())
    assert len(engine.sent) == len(set(engine.sent))
    generated = {rid for rid, rs in by_id.items() if rs[0]["twin_of"] is None}
    assert generated == set(engine.sent)
    prompt_of = {f"s{s}-{j}": prompts[30 * s + j] for s in range(2) for j in range(30)}
    for rid, rs in by_id.items():
        of = rs[0]["twin_of"]
        assert all(r["twin_of"] == of for r in rs)
        if of is not None:
            assert of in generated and prompt_of[of] == prompt_of[rid]
            assert sorted(r["generated_text"] for r in rs) == sorted(r["generated_text"] for r in by_id[of])
    # evicted results were generated again; the rest came from a twin
    assert 5 < len(engine.sent) < 60
    assert result.summary["totals"]["rows_from_twin"] == 4 * (60 - len(engine.sent))


def test_eviction_drops_only_finished_results_never_what_a_waiting_twin_needs():
    """A request in flight with twins waiting while many other results finish and are evicted
    from a tiny cache: its twins are still served when it finishes; a result larger than the
    whole bound is not kept; the estimate never exceeds the bound."""
    from batchspec.columns import empty_result
    from batchspec.run.twins import result_bytes

    one = [{**empty_result(), "generated_text": "x" * 100, "finish_reason": "stop"}]
    bound = 3 * result_bytes(one)
    twins = Twins({"temperature": 0.0}, window=100, hold=8, max_bytes=bound)
    slow = [Row("s", i, f"slow{i}", {}, prompt="slow") for i in range(3)]
    assert list(twins.primaries(iter(slow))) == slow[:1]  # two twins wait
    for i in range(10):
        row = Row("s", 10 + i, f"r{i}", {}, prompt=f"other {i}")
        assert list(twins.primaries(iter([row]))) == [row]
        assert twins.finished(row, [{**one[0], "generated_text": f"{i}" * 100}]) == []
        assert 0 < twins.cached_bytes <= bound
    served = twins.finished(slow[0], [{**one[0], "generated_text": "SLOW"}])
    assert [(t.request_id, r[0]["generated_text"], r[0]["twin_of"]) for t, r in served] == [
        ("slow1", "SLOW", "slow0"),
        ("slow2", "SLOW", "slow0"),
    ]
    # the oldest went first: r9 is still kept, r0 was generated again
    late = [Row("s", 30, "late9", {}, prompt="other 9"), Row("s", 31, "late0", {}, prompt="other 0")]
    assert list(twins.primaries(iter(late))) == late[1:]
    assert [t.request_id for t, _ in twins.ready()] == ["late9"]
    # a result larger than the bound is not kept: its later twin is generated
    big = Row("s", 40, "big", {}, prompt="big")
    assert list(twins.primaries(iter([big]))) == [big]
    twins.finished(big, [{**one[0], "generated_text": "x" * (2 * bound)}])
    assert twins.cached_bytes <= bound
    again = Row("s", 41, "big again", {}, prompt="big")
    assert list(twins.primaries(iter([again]))) == [again]


def test_dedupe_max_bytes_is_a_number_of_bytes():
    from batchspec.errors import SpecError
    from batchspec.spec.model import ExecutionSpec

    raw = {
        "input": {"path": "in/*.parquet", "prompt_column": "prompt"},
        "output": {"path": "out"},
        "model": {"target": "t"},
    }
    assert build_spec(raw).execution.dedupe_max_bytes == ExecutionSpec.dedupe_max_bytes > 0
    assert build_spec({**raw, "execution": {"dedupe_max_bytes": 0}}).execution.dedupe_max_bytes == 0
    for bad in (-1, "64MiB", 1.5, True):
        with pytest.raises(SpecError) as err:
            build_spec({**raw, "execution": {"dedupe_max_bytes": bad}})
        assert err.value.key == "execution.dedupe_max_bytes"


# --------------------------------------------------------------------------- engine errors


class _First:
    """An engine that finishes requests in the order it took them."""

    def randrange(self, n):
        return 0


class FailingOnce(CountingEngine):
    """Fails the first request for ``prompt`` as vLLM fails a request (finish reason
    ``error``), once; finishes requests in order."""

    def __init__(self, prompt, **kw):
        super().__init__(**kw)
        self.rng = _First()
        self.prompt, self.failed = prompt, False

    def stream(self, rows, *args, **kwargs):
        from batchspec.columns import empty_result

        for row, results in super().stream(rows, *args, **kwargs):
            if row.prompt == self.prompt and not self.failed:
                self.failed = True
                results = [
                    {
                        **empty_result(),
                        "finish_reason": "error",
                        "num_output_tokens": 0,
                        "error": "engine error: vLLM failed this request after 0 output tokens",
                    }
                ]
            yield row, results


def _engine_error_run(tmp_path, prompts, max_in_flight):
    _shards(tmp_path, [prompts])
    spec = build_spec({**_raw(tmp_path), "execution": {"max_in_flight": max_in_flight, "prefix_window": 0}})
    engine = FailingOnce("x")
    result, _ = run(spec, engine=engine)
    return engine, result, _rows(tmp_path)


@pytest.mark.vllm
def test_twins_of_a_request_the_engine_failed_are_generated_not_given_its_error(tmp_path):
    """``x`` fails once in the engine while two twins wait for it and the input goes on: the
    failed row keeps its error, one twin is sent to the engine, the other and a later ``x``
    get that twin's text; the error is never copied or kept."""
    engine, result, rows = _engine_error_run(
        tmp_path, ["x", "x", "x", "a", "b", "c", "d", "e", "x", "f"], max_in_flight=2
    )
    assert len(rows) == 10
    assert rows["s0-0"]["error"].startswith("engine error") and rows["s0-0"]["twin_of"] is None
    assert engine.sent.count("s0-0") == 1 and "s0-1" in engine.sent
    assert rows["s0-1"]["twin_of"] is None and rows["s0-1"]["generated_text"] == "X"
    for rid in ("s0-2", "s0-8"):
        assert rows[rid]["error"] is None and rows[rid]["generated_text"] == "X"
        assert rows[rid]["twin_of"] == "s0-1"
    assert sorted(engine.sent) == sorted(["s0-0", "s0-1", "s0-3", "s0-4", "s0-5", "s0-6", "s0-7", "s0-9"])
    assert [r for r in rows.values() if r["error"] is not None] == [rows["s0-0"]]
    assert result.summary["totals"]["rows_from_twin"] == 2


@pytest.mark.vllm
def test_twins_of_a_request_failed_after_the_input_ran_out_are_generated_too(tmp_path):
    """The same once every row was read: the waiting twins are not stranded (the shard is
    committed with every row) and not given the error."""
    engine, result, rows = _engine_error_run(tmp_path, ["x", "x", "x", "y"], max_in_flight=5)
    assert sorted(rows) == ["s0-0", "s0-1", "s0-2", "s0-3"]
    assert rows["s0-0"]["error"].startswith("engine error")
    assert rows["s0-1"]["twin_of"] is None and rows["s0-1"]["generated_text"] == "X"
    assert rows["s0-2"]["twin_of"] == "s0-1" and rows["s0-2"]["generated_text"] == "X"
    assert engine.sent == ["s0-0", "s0-3", "s0-1"]
    assert list(result.summary["shards"]) == ["s0"]


def test_an_error_is_never_a_twins_answer():
    """Unit view: a refusal or an engine error is neither copied to waiting twins nor kept; one
    waiting twin goes to the engine next, the others wait for it again. Answers are kept."""
    twins = Twins({"temperature": 0.0}, window=100, hold=8)
    rows = [Row("s", i, f"r{i}", {}, prompt="p") for i in range(4)]
    assert list(twins.primaries(iter(rows[:3]))) == rows[:1]
    refused = [{"generated_text": None, "error": "prompt too long", "finish_reason": "error"}]
    assert twins.finished(rows[0], refused) == []
    assert twins.cached_bytes == 0
    # r1 goes next (before the rest of the input), r2 and r3 wait for it
    assert list(twins.primaries(iter(rows[3:]))) == [rows[1]]
    failed = [
        {"generated_text": None, "error": "engine error: vLLM failed this request", "finish_reason": "error"}
    ]
    assert twins.finished(rows[1], failed) == []
    # the input ran out: what is left to send comes from retries()
    again = twins.retries()
    assert again is not None and list(again) == [rows[2]]
    assert twins.retries() is None
    served = twins.finished(rows[2], [{"generated_text": "P", "error": None, "finish_reason": "stop"}])
    assert [(t.request_id, r[0]["twin_of"]) for t, r in served] == [("r3", "r2")]
    later = Row("s", 9, "r9", {}, prompt="p")
    assert list(twins.primaries(iter([later]))) == []
    assert [(t.request_id, r[0]["twin_of"]) for t, r in twins.ready()] == [("r9", "r2")]
