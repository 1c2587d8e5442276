"""Shared prefixes together (``execution.prefix_window``): each shard's rows in sorted windows
(batchspec/run/prefixes.py), and the engine holding a request whose first cache block another
is computing (batchspec/engine/pacing.py). The order and the pacer alone, then a documents x
questions job on the real engine: vLLM's prefix cache serves far more of the prompts, every
row is written once, and the text is the same as in file order."""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest
from helpers.jobs import ROOT, write_job

from batchspec.engine.pacing import PrefixPacer
from batchspec.io.rows import Row
from batchspec.run.prefixes import prefix_order, sort_key
from batchspec.spec.load import load_spec

sys.path.insert(0, str(ROOT / "tools"))


def _row(
    i: int, prompt: str | None = None, lora: str | None = None, messages=None, error: str | None = None
) -> Row:
    return Row(
        shard="s",
        index=i,
        request_id=f"r{i}",
        kept={},
        prompt=prompt,
        messages=messages,
        lora=lora,
        error=error,
    )


def test_each_window_is_sorted_and_no_row_waits_beyond_it():
    prompts = ["doc B q1", "doc A q1", "doc B q2", "doc A q2", "doc C q1", "doc A q3", "doc C q2"]
    pulled = []

    def rows():
        for i, p in enumerate(prompts):
            pulled.append(i)
            yield _row(i, p)

    out = prefix_order(rows(), window=4)
    first = next(out)
    assert len(pulled) == 4, "a window is read, never more"
    order = [first.prompt] + [r.prompt for r in out]
    assert order == ["doc A q1", "doc A q2", "doc B q1", "doc B q2", "doc A q3", "doc C q1", "doc C q2"]


def test_window_0_keeps_file_order_and_refused_rows_pass_at_once():
    rows = [_row(0, "b"), _row(1, error="null prompt"), _row(2, "a")]
    assert [r.index for r in prefix_order(iter(rows), 0)] == [0, 1, 2]
    assert [r.index for r in prefix_order(iter(rows), 8)] == [1, 2, 0]


def test_rows_group_by_adapter_then_text_and_chat_by_messages_in_order():
    a = _row(0, "same text", lora="upper")
    b = _row(1, "same text")
    c = _row(2, "same text", lora="comment")
    assert [r.index for r in sorted([a, b, c], key=sort_key)] == [1, 2, 0]
    system = {"role": "system", "content": "You label code."}
    chat = [
        _row(i, messages=[system, {"role": "user", "content": u}]) for i, u in enumerate(["zeta", "alpha"])
    ]
    other = _row(
        9,
        messages=[
            {"role": "system", "content": "Another system prompt."},
            {"role": "user", "content": "alpha"},
        ],
    )
    ordered = sorted([chat[0], other, chat[1]], key=sort_key)
    assert [r.index for r in ordered] in ([9, 1, 0], [1, 0, 9])  # one system prompt together


def test_the_pacer_holds_a_shared_first_block_until_its_prefill_ran():
    pacer = PrefixPacer(block_size=4, tokens_per_step=10)
    doc = [7, 7, 7, 7]
    assert pacer.hold_until(doc + [1, 2], step=0) is None  # the first computes the block
    assert pacer.hold_until(doc + [3], step=0) == 1  # held until one step ran
    assert pacer.hold_until(doc + [3, 4, 5], step=1) is None  # cached by then
    assert pacer.hold_until([1, 2, 3], step=0) is None  # no full block to share
    assert pacer.hold_until([1, 2, 3], step=0) is None
    long = [5] * 25  # 25 tokens at 10 a step: three steps of prefill
    assert pacer.hold_until(long, step=4) is None
    assert pacer.hold_until(long, step=5) == 7 and pacer.hold_until(long, step=7) is None
    assert pacer.held == 2


def test_the_pacer_forgets_the_oldest_blocks_first():
    pacer = PrefixPacer(block_size=2, tokens_per_step=100, memory=2)
    for first in (1, 2, 3):
        pacer.hold_until([first, first, 0], step=0)
    assert pacer.hold_until([1, 1, 0], step=0) is None  # forgotten: treated as new
    assert pacer.hold_until([3, 3, 0], step=0) == 1


@pytest.mark.parametrize("value", [-1, True, "many"])
def test_a_bad_window_names_its_key(tmp_path, value):
    from batchspec.errors import SpecError

    job = write_job(
        tmp_path / "job.yaml",
        input={"path": "in/*.parquet", "prompt_column": "p"},
        output={"path": "out"},
        execution={"prefix_window": value},
    )
    with pytest.raises(SpecError) as err:
        load_spec(job)
    assert err.value.key == "execution.prefix_window"


# --------------------------------------------------------------------------- the real engine


#: KV cache blocks (128 tokens each on the CPU build) of the engine below: eight requests of about
#: 400 tokens in flight take 32 of them.
BLOCKS = 40
#: Documents, four questions each: their shared blocks (3 each) are far more than the cache holds.
DOCUMENTS = 40


@pytest.mark.engine
def test_documents_and_questions_share_the_prefix_cache_on_the_real_engine(tmp_path, shared_engines):
    """Forty documents, four questions each, scattered in the file; a KV cache of 40 blocks,
    far too small to keep every document (as a real cache is for a real dataset). In file order
    a document is mostly evicted before its next question comes; sorted and paced, each
    document's later questions read its blocks. Same rows, same greedy text."""
    from demo_data import document_questions_table

    (tmp_path / "in").mkdir()
    pq.write_table(document_questions_table(DOCUMENTS, 4, seed=500), tmp_path / "in" / "docs.parquet")
    runs, texts = {}, {}
    for window in (0, 1024):
        job = write_job(
            tmp_path / f"job-{window}.yaml",
            input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
            output={"path": str(tmp_path / f"out-{window}")},
            sampling={"temperature": 0.0, "max_tokens": 8},
            execution={"prefix_window": window, "dedupe_window": 0, "max_in_flight": 8},
        )
        spec = load_spec(job, [f"model.engine.num_gpu_blocks_override={BLOCKS}"])
        assert shared_engines.engine(spec).reset_prefix_cache()  # nothing from the other run
        run = shared_engines.run(spec)
        assert run.exit_code == 0, run.log
        rows = pq.read_table(tmp_path / f"out-{window}" / "docs.parquet").to_pylist()
        assert sorted(r["request_id"] for r in rows) == sorted(
            f"d{d:04d}-q{q:02d}" for d in range(DOCUMENTS) for q in range(4)
        )
        assert all(r["error"] is None for r in rows)
        runs[window] = run.summary["prefix_cache"]
        texts[window] = {r["request_id"]: r["generated_text"] for r in rows}
    # not released here: stopping an in-process engine tears down the parallel state the others
    # still use until another engine starts; the pool stops it when it starts the next one
    assert texts[0] == texts[1024]
    off, on = runs[0], runs[1024]
    print("prefix cache: file order", off, "sorted and paced", on)
    assert off["queries"] > 0 and on["queries"] > 0
    # each document's first question computes its three shared blocks, the other three read them
    assert on["hit_rate"] > 0.45, runs
    assert on["hit_rate"] > off["hit_rate"] + 0.2, runs

    # what tune relies on to time every pass as the job would: a prompt sent again after
    # Engine.reset_prefix_cache prefills in full, and without it reads the cache
    from batchspec.stats import prefix_cache

    engine = shared_engines.engine(spec)
    doc = _row(0, pq.read_table(tmp_path / "in" / "docs.parquet")["prompt"][0].as_py())
    hits = []
    for reset in (True, False, True):
        if reset:
            assert engine.reset_prefix_cache()
        before = engine.spec_counters()
        assert [r[0]["error"] for _, r in engine.stream(iter([doc]), max_in_flight=1)] == [None]
        hits.append(prefix_cache(before, engine.spec_counters())["hits"])
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0, hits
