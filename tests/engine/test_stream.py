"""batchspec's own :class:`~batchspec.engine.llm.Engine` over a stubbed vLLM engine: what one row
can do to the stream (fast; the same rows run on the real engine in test_bad_rows_e2e.py).

Nothing a row sends may end the run: a value vLLM asserts on, an output that cannot be read.
``max_in_flight`` counts sequences (a row's ``n``), and an engine that dies anyway is reported
with the rows it was handed since its last good step."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from batchspec.engine.llm import Engine
from batchspec.engine.supervise import EngineDied
from batchspec.errors import RuntimeFailure
from batchspec.io.rows import Row
from batchspec.spec.build import build_spec

#: vLLM's SamplingParams, stubbed engine or not
pytestmark = pytest.mark.vllm


class StubTokenizer:
    def encode(self, text):
        return [ord(c) % 200 + 1 for c in text]


class StubVllm:
    """``llm_engine``'s request interface: each step finishes the oldest request (its ``n``
    samples). ``die_on`` names a prompt whose step raises, as a killed engine does."""

    def __init__(self, die_on: str | None = None, unreadable: str | None = None):
        self.requests: dict[str, tuple] = {}
        self.max_sequences = 0
        self.die_on = die_on
        self.unreadable = unreadable
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        from vllm import SamplingParams

        assert isinstance(params, SamplingParams)
        self.requests[request_id] = (prompt["prompt_token_ids"], params)
        self.max_sequences = max(self.max_sequences, sum(p.n for _, p in self.requests.values()))

    def step(self):
        if not self.requests:
            return []
        rid = next(iter(self.requests))
        ids, params = self.requests.pop(rid)
        text = "".join(chr(i - 1) for i in ids[:4])
        if self.die_on is not None and text.startswith(self.die_on):
            raise RuntimeError("manual_seed expected a long")
        completions = [
            SimpleNamespace(
                index=i,
                text=text,
                token_ids=[1, 2],
                finish_reason="stop",
                stop_reason=None,
                spec_decode_metrics=None,
                logprobs=None,
                cumulative_logprob=None,
            )
            for i in range(params.n)
        ]
        if self.unreadable is not None and text.startswith(self.unreadable):
            completions = None  # an output batchspec cannot read
        return [
            SimpleNamespace(
                request_id=rid,
                finished=True,
                outputs=completions,
                prompt_token_ids=ids,
                metrics=None,
                prompt_logprobs=None,
            )
        ]

    def abort_request(self, ids):
        self.aborted.extend(ids)
        for rid in ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)


def stub_engine(vllm_engine: StubVllm, **sampling) -> Engine:
    """A real :class:`Engine` over ``vllm_engine``: no model, no process."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = build_spec(
        {
            "name": "stub",
            "input": {"path": "memory://in/*.parquet", "prompt_column": "p"},
            "output": {"path": "memory://out"},
            "model": {"target": "stub"},
            "sampling": {"temperature": 0.0, "max_tokens": 4, **sampling},
            "execution": {"prefix_window": 0},
        }
    )
    engine = Engine.__new__(Engine)
    engine._SamplingParams = SamplingParams
    engine._final_only = RequestOutputKind.FINAL_ONLY
    engine.engine = vllm_engine
    engine.tokenizer = StubTokenizer()
    engine.max_model_len = 1000
    engine.max_logprobs = 20
    engine.prefix_block = None
    engine.tokens_per_step = 1000
    engine._ids = itertools.count()
    engine._use(spec)
    return engine


def row(i: int, prompt: str, **overrides) -> Row:
    r = Row(shard="s", index=i, request_id=f"r{i}", kept={})
    r.prompt = prompt
    r.overrides = overrides
    return r


def test_a_value_vllm_asserts_on_is_that_rows_error_and_the_rest_run():
    stub = StubVllm()
    rows = [
        row(0, "AAAA"),
        row(1, "BBBB", stop={"a": 1}),
        row(2, "CCCC", seed="7"),
        row(3, "DDDD", seed=1.5),
        row(4, "EEEE", stop=[["x"]]),
        row(5, "FFFF", seed=42.0),
    ]
    out = {r.request_id: results for r, results in stub_engine(stub).stream(iter(rows), max_in_flight=4)}
    assert sorted(out) == [f"r{i}" for i in range(6)]
    assert out["r0"][0]["error"] is None and out["r5"][0]["error"] is None  # 42.0 is 42
    assert "stop: expected a string or a list of strings" in out["r1"][0]["error"]
    assert "seed: expected an integer" in out["r2"][0]["error"]
    assert "seed: expected an integer" in out["r3"][0]["error"]
    assert "stop: expected a string or a list of strings" in out["r4"][0]["error"]


def test_max_in_flight_counts_sequences_not_rows():
    stub = StubVllm()
    rows = [row(i, f"{chr(65 + i)}xyz", n=3) for i in range(10)] + [row(10, "Kxyz", n=12)]
    out = list(stub_engine(stub, seed=1, temperature=0.8).stream(iter(rows), max_in_flight=8))
    assert len(out) == 11
    assert sum(len(results) for _, results in out) == 10 * 3 + 12
    # 8 sequences at most, but for the row with more samples than that, which runs alone
    assert stub.max_sequences == 12
    stub = StubVllm()
    list(stub_engine(stub, seed=1, temperature=0.8).stream(iter(rows[:10]), max_in_flight=8))
    assert stub.max_sequences <= 8


def test_n_above_the_jobs_cap_is_an_error_row():
    rows = [row(0, "AAAA", n=129), row(1, "BBBB", n=2)]
    out = dict(
        (r.request_id, res)
        for r, res in stub_engine(StubVllm(), seed=3, temperature=0.8).stream(iter(rows), max_in_flight=8)
    )
    assert "more than execution.max_n (128)" in out["r0"][0]["error"]
    assert len(out["r1"]) == 2 and out["r1"][0]["error"] is None


def test_an_output_that_cannot_be_read_is_that_rows_error():
    rows = [row(0, "AAAA"), row(1, "BBBB"), row(2, "CCCC")]
    out = dict(
        (r.request_id, res)
        for r, res in stub_engine(StubVllm(unreadable="BBBB")).stream(iter(rows), max_in_flight=2)
    )
    assert out["r1"][0]["error"].startswith("cannot read the engine's output")
    assert out["r0"][0]["error"] is None and out["r2"][0]["error"] is None


def test_an_engine_that_dies_anyway_names_the_rows_it_was_just_handed():
    rows = [row(0, "AAAA"), row(1, "BBBB"), row(2, "CCCC")]
    stream = stub_engine(StubVllm(die_on="AAAA")).stream(iter(rows), max_in_flight=2)
    with pytest.raises(RuntimeFailure) as err:
        list(stream)
    assert "manual_seed expected a long" in str(err.value)
    assert "'r0' (shard s)" in str(err.value) and "'r1' (shard s)" in str(err.value)
    assert "'r2'" not in str(err.value)
    # what a supervisor (batchspec/engine/supervise.py) sends again: the rows it had, none
    # taken and left unsent here
    assert isinstance(err.value, EngineDied)
    assert [r.request_id for r in err.value.in_flight] == ["r0", "r1"] and err.value.unsent == []
    assert err.value.reason == "RuntimeError: manual_seed expected a long"
