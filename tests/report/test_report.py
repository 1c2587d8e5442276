"""`batchspec report` on small outputs written by hand: every figure checked against numbers
worked out by hand in this file (percentiles too), never against report's own helpers.

No engine: the output files are built with pyarrow, with the output schema of docs/contract.md
written out here (not taken from batchspec.columns), so that a drift in either shows.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
from html.parser import HTMLParser
from pathlib import Path

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchspec.cli import main
from batchspec.errors import InputDataError, SpecError
from batchspec.report.comparison import build_comparison, compare
from batchspec.report.html import nice_ticks, render_html
from batchspec.report.metrics import build_report, summarize
from batchspec.report.read import load_output, parse_storage_options
from batchspec.report.text import markdown_text, render

RUN_ID = "20260101T000000Z-aaaaaa"
META = {
    "run_id": RUN_ID,
    "job": "t",
    "target_model": "tgt",
    "draft_model": "dft",
    "speculative_method": "draft_model",
    "vllm_version": "0.32.0",
    "batchspec_version": "0.1.0",
    "spec": {"speculative": {"method": "draft_model", "num_speculative_tokens": 3}},
}

#: docs/contract.md's output columns, in order, with one kept input column (``topic``).
SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("topic", pa.string()),
        ("generated_text", pa.string()),
        ("finish_reason", pa.string()),
        ("num_prompt_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()),
        ("spec_num_steps", pa.int32()),
        ("spec_num_draft_tokens", pa.int32()),
        ("spec_num_accepted_tokens", pa.int32()),
        ("spec_acceptance_rate", pa.float64()),
        ("spec_mean_acceptance_length", pa.float64()),
        ("spec_acceptance_histogram", pa.list_(pa.int32())),
        ("time_queued_s", pa.float64()),
        ("time_to_first_token_s", pa.float64()),
        ("time_decode_s", pa.float64()),
        ("time_e2e_s", pa.float64()),
        ("output_tokens_per_s", pa.float64()),
        ("error", pa.string()),
    ]
)


def ok(
    rid: str,
    text: str,
    out: int,
    ttft: float,
    e2e: float,
    tps: float,
    spec: tuple[int, int, int, list[int]] | None = None,
) -> dict:
    """A successful row; ``spec`` = (steps, drafted, accepted, histogram) or None (spec off)."""
    row = dict.fromkeys(SCHEMA.names)
    row.update(
        request_id=rid,
        topic="x",
        generated_text=text,
        finish_reason="length",
        num_prompt_tokens=5,
        num_output_tokens=out,
        time_queued_s=0.0,
        time_to_first_token_s=ttft,
        time_decode_s=e2e - ttft,
        time_e2e_s=e2e,
        output_tokens_per_s=tps,
    )
    if spec:
        steps, drafted, accepted, hist = spec
        row.update(
            spec_num_steps=steps,
            spec_num_draft_tokens=drafted,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / drafted,
            spec_mean_acceptance_length=1 + accepted / steps,
            spec_acceptance_histogram=hist,
        )
    return row


def failed(rid: str, message: str) -> dict:
    row = dict.fromkeys(SCHEMA.names)
    row.update(
        request_id=rid,
        topic="x",
        finish_reason="error",
        num_prompt_tokens=5,
        num_output_tokens=0,
        error=message,
    )
    return row


def write_output(root: Path, shards: dict[str, list[dict]], meta: dict = META, runs: list[dict] = ()) -> str:
    """An output directory as the runner leaves it: one file per shard, run summaries."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in shards.items():
        schema = SCHEMA.with_metadata({b"batchspec": json.dumps({**meta, "shard": name}).encode()})
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), root / f"{name}.parquet")
    (root / "_batchspec" / "runs").mkdir(parents=True, exist_ok=True)
    # bookkeeping is not output: a stray file under _batchspec/ must not be read
    (root / "_batchspec" / "tmp").mkdir(exist_ok=True)
    (root / "_batchspec" / "tmp" / "s9.parquet").write_bytes(b"not parquet")
    for run in runs:
        (root / "_batchspec" / "runs" / f"{run['run_id']}.json").write_text(json.dumps(run))
    return str(root)


#: Shard s0 and s1 of run A. k = 3; each histogram has sum(h) = steps, sum(j * h[j]) = accepted.
A_SHARDS = {
    "s0": [
        ok("r1", "a", 10, 0.1, 1.0, 10.0, (4, 12, 6, [1, 1, 1, 1])),
        ok("r2", "b", 20, 0.2, 2.0, 20.0, (5, 15, 12, [0, 1, 1, 3])),
        failed("r3", "prompt too long: 600 tokens > 512"),
    ],
    "s1": [
        ok("r4", "c", 30, 0.3, 3.0, 30.0, (10, 30, 15, [2, 3, 3, 2])),
        ok("r5", "d", 40, 0.4, 4.0, 40.0, (8, 24, 24, [0, 0, 0, 8])),
        failed("r6", "empty prompt"),
        failed("r7", "prompt too long: 700 tokens > 512"),
    ],
}
RUNS = [
    {"run_id": RUN_ID, "acceptance_per_position": {"num_drafts": 27, "accepted": [24, 19, 14]}},
    # another output's run: its counters are not this output's
    {"run_id": "20250101T000000Z-other", "acceptance_per_position": {"num_drafts": 5, "accepted": [5, 5, 5]}},
]
B_ROWS = [
    ok("r1", "a", 10, 0.1, 0.5, 20.0, (4, 12, 7, [1, 1, 0, 2])),  # rate 0.5 -> 7/12
    ok("r1", "dup", 10, 0.1, 0.5, 20.0, (4, 12, 12, [0, 0, 0, 4])),  # duplicate id
    ok("r2", "changed", 20, 0.2, 1.0, 40.0, (5, 15, 12, [0, 1, 1, 3])),  # rate 0.8 -> 0.8
    ok("r4", "c", 30, 0.3, 1.5, 60.0, (10, 30, 12, [2, 4, 4, 0])),  # rate 0.5 -> 0.4
    ok("r5", "d", 40, 0.4, 2.0, 80.0, (8, 24, 24, [0, 0, 0, 8])),  # rate 1.0 -> 1.0
    failed("r6", "empty prompt"),
    ok("r8", "new", 5, 0.1, 0.2, 50.0, (2, 6, 3, [1, 0, 0, 1])),
]


@pytest.fixture
def out_a(tmp_path) -> str:
    return write_output(tmp_path / "a", A_SHARDS, runs=RUNS)


@pytest.fixture
def out_b(tmp_path) -> str:
    return write_output(tmp_path / "b", {"s0": B_ROWS})


@pytest.fixture
def out_off(tmp_path) -> str:
    meta = {**META, "draft_model": None, "speculative_method": None, "spec": {"speculative": None}}
    rows = [ok("r1", "a", 10, 0.1, 1.0, 10.0), ok("r2", "b", 20, 0.2, 2.0, 20.0), failed("r3", "x: y")]
    return write_output(tmp_path / "off", {"s0": rows}, meta=meta)


_memory_dirs = itertools.count()


@pytest.fixture
def to_memory():
    """Copy a local output directory to memory:// (an object store as fsspec sees it, read
    through the pyarrow-dataset path of the report); returns the memory:// URL."""
    fs = fsspec.filesystem("memory")
    made = []

    def copy(local: str) -> str:
        base = f"/report-test-{next(_memory_dirs)}"
        for path in Path(local).rglob("*"):
            if path.is_file():
                fs.pipe(f"{base}/{path.relative_to(local).as_posix()}", path.read_bytes())
        made.append(base)
        return f"memory://{base}"

    yield copy
    for base in made:
        fs.rm(base, recursive=True)


def section(text: str, start: str) -> str:
    """The part of ``text`` from ``start`` to the next blank line."""
    i = text.index(start)
    end = text.find("\n\n", i)
    return text[i:] if end < 0 else text[i:end]


# ---- figures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_figures_match_hand_computation(out_a, to_memory, where):
    url = out_a if where == "local" else to_memory(out_a)
    r = build_report(url)
    m = r["overall"]
    assert (r["files"], m["rows"], m["errors"]) == (2, 7, 3)
    assert m["errors_by_reason"] == {"empty prompt": 1, "prompt too long": 2}
    assert m["finish_reasons"] == {"error": 3, "length": 4}
    assert (m["prompt_tokens"], m["output_tokens"]) == (35, 100)  # 7 rows x 5; 10+20+30+40
    # steps 4+5+10+8, drafted 12+15+30+24, accepted 6+12+15+24
    assert (m["spec_num_steps"], m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"]) == (27, 81, 57)
    assert m["acceptance_rate"] == pytest.approx(57 / 81)  # sum / sum, not a mean of rates (0.7)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 57 / 27)
    assert m["acceptance_histogram"] == [3, 5, 5, 14]  # element-wise sum of the four rows'

    # per-request rates 0.5, 0.8, 0.5, 1.0 -> sorted 0.5 0.5 0.8 1.0; linear interpolation at
    # h = (n - 1) * p: p50 at 1.5 -> 0.65, p90 at 2.7 -> 0.8 + 0.7 * 0.2, p99 at 2.97
    assert m["acceptance_rate_per_request"] == pytest.approx(
        {"count": 4, "mean": 0.7, "min": 0.5, "p50": 0.65, "p90": 0.94, "p99": 0.994, "max": 1.0}
    )
    # lengths 1 + 6/4, 1 + 12/5, 1 + 15/10, 1 + 24/8 -> 2.5 2.5 3.4 4.0
    assert m["acceptance_length_per_request"] == pytest.approx(
        {"count": 4, "mean": 3.1, "min": 2.5, "p50": 2.95, "p90": 3.82, "p99": 3.982, "max": 4.0}
    )
    # failed rows have no timings: e2e 1 2 3 4, TTFT .1 .2 .3 .4, tok/s 10 20 30 40
    assert m["e2e_s"] == pytest.approx(
        {"count": 4, "mean": 2.5, "min": 1.0, "p50": 2.5, "p90": 3.7, "p99": 3.97, "max": 4.0}
    )
    assert m["ttft_s"] == pytest.approx(
        {"count": 4, "mean": 0.25, "min": 0.1, "p50": 0.25, "p90": 0.37, "p99": 0.397, "max": 0.4}
    )
    assert m["decode_tokens_per_s"] == pytest.approx(
        {"count": 4, "mean": 25.0, "min": 10.0, "p50": 25.0, "p90": 37.0, "p99": 39.7, "max": 40.0}
    )

    s0, s1 = r["shards"]["s0"], r["shards"]["s1"]
    assert (s0["rows"], s0["errors"], s0["output_tokens"], s0["run_id"]) == (3, 1, 30, RUN_ID)
    assert (s0["spec_num_steps"], s0["spec_num_draft_tokens"], s0["spec_num_accepted_tokens"]) == (9, 27, 18)
    assert s0["acceptance_rate"] == pytest.approx(18 / 27)
    assert s0["mean_acceptance_length"] == pytest.approx(1 + 18 / 9)
    assert s0["acceptance_histogram"] == [1, 2, 2, 4]
    assert (s0["e2e_s"]["p50"], s0["e2e_s"]["p90"]) == pytest.approx((1.5, 1.9))
    assert s0["errors_by_reason"] == {"prompt too long": 1}
    assert (s1["rows"], s1["errors"], s1["output_tokens"]) == (4, 2, 70)
    assert s1["acceptance_rate"] == pytest.approx(39 / 54)
    assert s1["acceptance_histogram"] == [2, 3, 3, 10]
    assert s1["errors_by_reason"] == {"empty prompt": 1, "prompt too long": 1}
    assert s1["finish_reasons"] == {"error": 2, "length": 2}
    assert (s1["decode_tokens_per_s"]["mean"], s1["ttft_s"]["p50"]) == pytest.approx((35.0, 0.35))

    lin = r["lineage"]
    assert lin["run_id"] == [RUN_ID] and lin["target_model"] == ["tgt"]
    assert lin["draft_model"] == ["dft"] and lin["num_speculative_tokens"] == [3]
    assert lin["vllm_version"] == ["0.32.0"] and lin["batchspec_version"] == ["0.1.0"]
    pos = r["acceptance_per_position"]
    assert pos["runs"] == [RUN_ID] and pos["num_drafts"] == 27 and pos["accepted"] == [24, 19, 14]
    assert pos["rate"] == pytest.approx([24 / 27, 19 / 27, 14 / 27])


def test_an_empty_shard_counts_zero(tmp_path):
    url = write_output(tmp_path / "e", {"s0": A_SHARDS["s0"], "s1": []})
    r = build_report(url)
    assert r["files"] == 2
    s1 = r["shards"]["s1"]
    assert (s1["rows"], s1["errors"], s1["output_tokens"], s1["prompt_tokens"]) == (0, 0, 0, 0)
    assert s1["speculative"] is False and s1["acceptance_rate"] is None and s1["e2e_s"] is None
    assert s1["errors_by_reason"] == {} and s1["acceptance_histogram"] is None
    assert (r["overall"]["rows"], r["overall"]["spec_num_accepted_tokens"]) == (3, 18)


def test_speculation_off_is_null_not_zero(out_off):
    r = build_report(out_off)
    m = r["overall"]
    assert m["speculative"] is False
    assert (m["spec_num_steps"], m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"]) == (None,) * 3
    assert m["acceptance_rate"] is None and m["mean_acceptance_length"] is None
    assert m["acceptance_histogram"] is None and m["acceptance_rate_per_request"] is None
    assert (m["e2e_s"]["p50"], m["output_tokens"], m["errors_by_reason"]) == (1.5, 30, {"x": 1})
    md = render(r, "markdown")
    assert "| acceptance rate | - (speculative decoding was off) |" in md
    assert "| mean acceptance length | - |" in md
    assert "| s0 | 3 | 1 | 30 | - | - | 0.150 | 1.500 | 1.900 | 15.0 | 15.0 |" in md
    parsed = json.loads(render(r, "json"))
    assert parsed["overall"]["acceptance_rate"] is None and parsed["overall"]["rows"] == 3
    html = render_html(r, [load_output(out_off)])
    assert "Speculative decoding was off: no acceptance data to chart." in html


# ---- rendered formats ------------------------------------------------------------------------


def test_markdown_cells(out_a):
    md = render(build_report(out_a), "markdown")
    summary = section(md, "| metric | value |")
    assert "| rows | 7 |" in summary and "| errors | 3 |" in summary
    assert "| finish reasons | error 3, length 4 |" in summary
    assert "| output tokens | 100 |" in summary and "| prompt tokens | 35 |" in summary
    assert "| acceptance rate | 0.704  (57 accepted / 81 drafted) |" in summary
    assert "| mean acceptance length | 3.11  (1 + accepted / 27 steps) |" in summary
    dist = section(md, "| metric | n | mean | p50 | p90 | p99 | max |")
    assert "| acceptance rate | 4 | 0.700 | 0.650 | 0.940 | 0.994 | 1.000 |" in dist
    assert "| acceptance length (tokens/step) | 4 | 3.10 | 2.95 | 3.82 | 3.98 | 4.00 |" in dist
    assert "| e2e latency (s) | 4 | 2.500 | 2.500 | 3.700 | 3.970 | 4.000 |" in dist
    assert "| TTFT (s) | 4 | 0.250 | 0.250 | 0.370 | 0.397 | 0.400 |" in dist
    assert "| decode speed (tok/s) | 4 | 25.0 | 25.0 | 37.0 | 39.7 | 40.0 |" in dist
    shards = section(md, "| shard | rows |")
    # rows, errors, output tokens, acceptance, accept len, TTFT p50, e2e p50/p90, tok/s p50/mean
    assert "| s0 | 3 | 1 | 30 | 0.667 | 3.00 | 0.150 | 1.500 | 1.900 | 15.0 | 15.0 |" in shards
    assert "| s1 | 4 | 2 | 70 | 0.722 | 3.17 | 0.350 | 3.500 | 3.900 | 35.0 | 35.0 |" in shards
    assert "|:---|---:|---:|" in shards
    assert "| prompt too long | 2 |" in section(md, "| reason | rows |")
    hist = section(md, "| accepted j | steps | share |")
    # 3 5 5 14 of 27 steps; the bar is round(30 * share) blocks
    assert "| 0 | 3 | 11.1% | ███ |" in hist and "| 3 | 14 | 51.9% | " + "█" * 16 + " |" in hist
    pos = section(md, "| position | accepted | rate |")
    assert "| 1 | 24 | 0.889 |" in pos and "| 3 | 14 | 0.519 |" in pos
    escaped = out_a.replace("_", "\\_")  # the tmp path's underscores, escaped for markdown
    assert md.startswith(f"# batchspec report: {escaped}\n")


def test_text_table_and_json(out_a):
    r = build_report(out_a)
    text = render(r, "table")
    rows = {line.split()[0]: line.split() for line in section(text, "Per shard").splitlines()[3:]}
    assert rows["s0"] == ["s0", "3", "1", "30", "0.667", "3.00", "0.150", "1.500", "1.900", "15.0", "15.0"]
    assert rows["s1"] == ["s1", "4", "2", "70", "0.722", "3.17", "0.350", "3.500", "3.900", "35.0", "35.0"]
    summary = section(text, "Summary")
    assert re.search(r"acceptance rate +0\.704  \(57 accepted / 81 drafted\)", summary)
    assert re.search(r"errors +3\n", summary)

    parsed = json.loads(render(r, "json"))
    assert parsed["overall"]["acceptance_histogram"] == [3, 5, 5, 14]
    assert parsed["overall"]["acceptance_rate"] == pytest.approx(57 / 81)
    assert parsed["overall"]["e2e_s"]["p99"] == pytest.approx(3.97)
    assert parsed["shards"]["s1"]["output_tokens"] == 70
    assert parsed["shards"]["s0"]["mean_acceptance_length"] == pytest.approx(3.0)


# ---- compare mode ----------------------------------------------------------------------------


def check_matching(mt: dict) -> None:
    assert (mt["matched"], mt["only_in_a"], mt["only_in_b"]) == (5, 2, 1)  # r3, r7 | r8
    assert (mt["duplicate_ids_a"], mt["duplicate_ids_b"]) == (0, 1)
    # r1 r2 r4 r5 succeeded in both (r6 failed in both); r2's text changed, r1's first row kept
    assert (mt["both_ok"], mt["identical_text"]) == (4, 3)
    assert mt["identical_text_fraction"] == pytest.approx(0.75)
    d = mt["acceptance_rate_diff"]
    # B - A per request: r1 7/12 - 1/2, r2 0, r4 0.4 - 0.5, r5 0 -> sorted -0.1 0 0 1/12
    assert d == pytest.approx(
        {
            "count": 4,
            "mean": (1 / 12 - 0.1) / 4,
            "min": -0.1,
            "p50": 0.0,
            "p90": 0.7 / 12,
            "p99": 0.97 / 12,
            "max": 1 / 12,
            "b_higher": 1,
            "a_higher": 1,
            "equal": 2,
        }
    )


def test_compare_figures(out_a, out_b):
    c = build_comparison(out_a, out_b)
    check_matching(c["matching"])
    ch = c["changes"]
    assert ch["rows"] == {"a": 7, "b": 7, "delta": 0, "ratio": 1.0}
    assert ch["errors"] == {"a": 3, "b": 1, "delta": -2, "ratio": pytest.approx(1 / 3)}
    # B: 10 + 10 + 20 + 30 + 40 + 0 + 5 output tokens; drafted 99, accepted 70, steps 33
    assert ch["output_tokens"] == {"a": 100, "b": 115, "delta": 15, "ratio": pytest.approx(1.15)}
    assert ch["acceptance_rate"] == pytest.approx(
        {"a": 57 / 81, "b": 70 / 99, "delta": 70 / 99 - 57 / 81, "ratio": (70 / 99) / (57 / 81)}
    )
    assert ch["mean_acceptance_length"]["b"] == pytest.approx(1 + 70 / 33)
    # B counts every row, its duplicate too: e2e .2 .5 .5 1 1.5 2 -> p50 at 2.5 = 0.75, p90 at
    # 4.5 = 1.75; tok/s 20 20 40 50 60 80 -> p50 45, mean 45
    assert ch["e2e_s.p50"] == pytest.approx({"a": 2.5, "b": 0.75, "delta": -1.75, "ratio": 0.3})
    assert ch["e2e_s.p90"] == pytest.approx({"a": 3.7, "b": 1.75, "delta": -1.95, "ratio": 1.75 / 3.7})
    assert ch["decode_tokens_per_s.p50"] == pytest.approx({"a": 25, "b": 45, "delta": 20, "ratio": 1.8})
    assert ch["decode_tokens_per_s.mean"]["b"] == pytest.approx(45)
    assert c["b"]["overall"]["acceptance_histogram"] == [4, 6, 5, 18]

    md = render(c, "markdown")
    assert "| rows | 7 | 7 | +0 | 1.000x |" in md
    assert "| output tokens | 100 | 115 | +15 | 1.150x |" in md
    assert "| acceptance rate | 0.704 | 0.707 | +0.003 | 1.005x |" in md
    assert "| e2e latency (s) p50 | 2.500 | 0.750 | -1.750 | 0.300x |" in md
    assert "| decode tok/s p50 | 25.0 | 45.0 | +20.0 | 1.800x |" in md
    assert "| only in B | 1 |" in md and "| duplicate ids (A, B) | 0, 1 |" in md
    assert "| identical generated\\_text | 3 (75.0% of both-successful) |" in md
    assert "| acceptance rate B - A, mean | -0.004 |" in md
    assert "| acceptance rate B - A, p50 / p90 | +0.000 / +0.058 |" in md
    assert "| requests B higher / A higher / equal | 1 / 1 / 2 |" in md
    assert "| 3 | 14 | 51.9% | 18 | 54.5% |" in md  # histogram shares of 27 and 33 steps
    text = render(c, "table")
    assert re.search(r"only in A +2\n", text) and re.search(r"matched +5\n", text)
    parsed = json.loads(render(c, "json"))
    assert parsed["matching"]["identical_text"] == 3 and parsed["changes"]["rows"]["b"] == 7


def test_compare_across_filesystems(out_a, out_b, to_memory):
    """Text hashes from the local reader and the fsspec one agree: same matching figures."""
    a = load_output(out_a)
    b = load_output(to_memory(out_b))
    check_matching(compare(a, b)["matching"])
    check_matching(compare(load_output(to_memory(out_a)), load_output(out_b))["matching"])


def test_compare_with_speculation_off(out_a, out_off):
    c = build_comparison(out_a, out_off)
    mt = c["matching"]
    # r1 r2 in both (same texts), r3 failed in A and in B
    assert (mt["matched"], mt["both_ok"], mt["identical_text"]) == (3, 2, 2)
    assert mt["acceptance_rate_diff"] is None
    assert c["changes"]["acceptance_rate"] == {
        "a": pytest.approx(57 / 81),
        "b": None,
        "delta": None,
        "ratio": None,
    }
    md = render(c, "markdown")
    assert "| acceptance rate | 0.704 | - | - | - |" in md
    assert "| acceptance rate B - A | - (needs acceptance data in both runs) |" in md
    html = render_html(c, [load_output(out_a), load_output(out_off)])
    assert "B: speculative decoding was off" in html  # the charts say whose data is missing


# ---- projection: a single-run report never reads generated_text ------------------------------


def corrupt_column(path: Path, column: str) -> None:
    """Overwrite every page of ``column`` (dictionary and data) with 0xFF bytes; the footer
    stays valid, so only a reader that decodes this column notices."""
    meta = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        chunk = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema == column)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_single_run_report_never_reads_generated_text(tmp_path, to_memory, where):
    root = Path(write_output(tmp_path / "a", A_SHARDS, runs=RUNS))
    for f in root.glob("*.parquet"):
        corrupt_column(f, "generated_text")
        # the damage is real: any reader that decodes the column fails on it
        with pytest.raises((OSError, pa.ArrowException)):
            pq.read_table(f, columns=["generated_text"])
        with pytest.raises((OSError, pl.exceptions.PolarsError)):
            pl.read_parquet(f, columns=["generated_text"])
    url = str(root) if where == "local" else to_memory(str(root))
    r = build_report(url)
    assert (r["overall"]["rows"], r["overall"]["output_tokens"]) == (7, 100)
    assert r["overall"]["acceptance_rate"] == pytest.approx(57 / 81)
    assert r["overall"]["e2e_s"]["p90"] == pytest.approx(3.7)
    assert "<svg" in render_html(r, [load_output(url)])  # the charts read rows too, not texts
    # compare mode does need the texts (as hashes): it meets the damage and names the file
    with pytest.raises(InputDataError, match=r"s0\.parquet: unreadable Parquet"):
        build_comparison(url, url)


def test_damaged_statistics_column_names_the_file(tmp_path):
    root = Path(write_output(tmp_path / "a", A_SHARDS))
    corrupt_column(root / "s1.parquet", "num_output_tokens")
    res = CliRunner().invoke(main, ["report", str(root)])
    assert res.exit_code == 3
    assert f"{root}/s1.parquet: unreadable Parquet" in res.output


# ---- hostile strings -------------------------------------------------------------------------

EVIL_SHARD = "s|`<svg onload=alert(1)>`&"
EVIL_META = {
    **META,
    "run_id": "r|<u>1</u>",
    "target_model": "/m/<script>alert(1)</script>|x",
    "draft_model": "d`x`\n# heading",
}
EVIL_REASON = "<b>bad</b> | `x`\n<i>next"


@pytest.fixture
def out_evil(tmp_path) -> str:
    rows = [
        ok("r1", "<script>t</script>", 10, 0.1, 1.0, 10.0, (4, 12, 6, [1, 1, 1, 1])),
        failed("r2", EVIL_REASON + ": detail"),
    ]
    return write_output(tmp_path / "out<x>|y", {EVIL_SHARD: rows}, meta=EVIL_META)


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_markdown_escapes_hostile_strings(out_evil):
    assert markdown_text("a|b") == "a\\|b"
    assert markdown_text("x\\|y") == "x\\\\\\|y"  # an escaped backslash, then an escaped pipe
    assert markdown_text("<a href='j'>&`") == "&lt;a href='j'&gt;&amp;\\`"
    assert markdown_text("one\r\ntwo\nthree") == "one<br>two<br>three"
    assert markdown_text("[x](javascript:y) *b* _i_") == "\\[x\\](javascript:y) \\*b\\* \\_i\\_"
    r = build_report(out_evil)
    for report in (r, build_comparison(out_evil, out_evil)):
        md = render(report, "markdown")
        assert "<" not in md.replace("<br>", ""), "raw HTML in the markdown"
        # every table row has exactly as many cell separators as its header
        for table in re.findall(r"(?:^\|.*\n)+", md, flags=re.M):
            lines = table.splitlines()
            assert {unescaped_pipes(line) for line in lines} == {unescaped_pipes(lines[0])}, table
        assert "\n# heading" not in md and "\n#" not in md.replace("\n## ", "")
    md = render(r, "markdown")
    shard_cell = "s\\|\\`&lt;svg onload=alert(1)&gt;\\`&amp;"
    assert f"| {shard_cell} | 2 | 1 | 10 | 0.500 | 2.50 |" in md
    assert "| &lt;b&gt;bad&lt;/b&gt; \\| \\`x\\`<br>&lt;i&gt;next | 1 |" in md
    assert "| run\\_id | r\\|&lt;u&gt;1&lt;/u&gt; |" in md
    assert "| draft\\_model | d\\`x\\`<br># heading |" in md


class Tags(HTMLParser):
    """Every tag and attribute name in a page."""

    def __init__(self):
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)


#: Every tag the report page draws with; anything else came from data.
PAGE_TAGS = {
    "html",
    "head",
    "meta",
    "title",
    "style",
    "body",
    "main",
    "header",
    "h1",
    "h2",
    "h3",
    "div",
    "code",
    "section",
    "svg",
    "line",
    "text",
    "rect",
    "circle",
    "table",
    "thead",
    "tbody",
    "tr",
    "th",
    "td",
    "i",
    "span",
    "footer",
}


def test_html_escapes_hostile_strings(out_evil):
    o = load_output(out_evil)
    for report, outputs in ((summarize(o), [o]), (compare(o, o), [o, o])):
        html = render_html(report, outputs)
        parser = Tags()
        parser.feed(html)
        assert parser.tags <= PAGE_TAGS, parser.tags - PAGE_TAGS
        assert not [a for a in parser.attrs if a.startswith("on")]
        assert "<script" not in html.lower() and "<svg onload" not in html
        # shard names show in the per-shard charts' axis labels (cut to 18) and bar titles
        assert "s|`&lt;svg onload=ale</text>" in html
        assert "s|`&lt;svg onload=alert(1)&gt;`&amp;: 10</title>" in html
    html = render_html(summarize(o), [o])
    assert "/m/&lt;script&gt;alert(1)&lt;/script&gt;|x" in html
    assert "&lt;b&gt;bad&lt;/b&gt; | `x`\n&lt;i&gt;next" in html


def test_lineage_urls_lose_their_credentials(tmp_path):
    """Model names from file metadata are printed through sanitize_url: no login, no query."""
    meta = {
        **META,
        "target_model": "s3://ann:pa55word@models/tgt?X-Amz-Signature=s1gn4ture",
        "draft_model": "https://hub.example/dft?token=t0ken-value",
    }
    url = write_output(tmp_path / "a", {"s0": A_SHARDS["s0"]}, meta=meta)
    r = build_report(url)
    assert r["lineage"]["target_model"] == ["s3://models/tgt"]
    assert r["lineage"]["draft_model"] == ["https://hub.example/dft"]
    o = load_output(url)
    shown = "".join(render(r, f) for f in ("table", "markdown", "json")) + render_html(r, [o])
    for secret in ("pa55word", "s1gn4ture", "t0ken-value", "ann:"):
        assert secret not in shown, secret


# ---- HTML ------------------------------------------------------------------------------------


def cards(html: str) -> dict[str, str]:
    """Each card of the page by its heading."""
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r'<section class="card[^"]*"><h3>([^<]*)</h3>.*?</section>', html, re.S)
    }


def assert_self_contained(html: str) -> None:
    for needle in ("<script", "<link", "<img", "<iframe", "<object", "src=", "href=", "url(", "@import"):
        assert needle not in html.lower(), needle
    # the only URL is SVG's namespace name, which is never fetched
    assert set(re.findall(r"(?:https?:)?//[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_html_charts_carry_the_figures(out_a):
    a = load_output(out_a)
    html = render_html(summarize(a), [a])
    assert_self_contained(html)
    assert html.count("<svg") == 7
    c = cards(html)
    # acceptance histogram: 3 5 5 14 of 27 steps in %
    hist = c["Acceptance histogram"]
    for j, share in enumerate(("11.1", "18.5", "18.5", "51.9")):
        assert f"<title>run {j}: {share}</title>" in hist and f">{share}</text>" in hist
    pos = c["Acceptance per draft position"]  # 24 19 14 of 27 drafts
    for i, share in enumerate(("88.9", "70.4", "51.9"), start=1):
        assert f"<title>run {i}: {share}</title>" in pos
    assert c["Acceptance rate vs output length"].count("<circle") == 4
    assert "(4 shown)" in c["Acceptance rate vs output length"]
    # e2e 1 2 3 4 s: ticks 0..4, 16 bins of 0.25 s; 4 falls in the last bin
    e2e = c["End-to-end latency"]
    for lo, hi in (("1", "1.25"), ("2", "2.25"), ("3", "3.25"), ("3.75", "4")):
        assert f"<title>run: 1 requests in [{lo}, {hi}) s</title>" in e2e
    assert e2e.count("<rect") == 4
    ttft = c["Time to first token"]  # 0.1 .. 0.4 s: 16 bins of 0.025 s
    for lo, hi in (("0.1", "0.125"), ("0.2", "0.225"), ("0.3", "0.325"), ("0.375", "0.4")):
        assert f"<title>run: 1 requests in [{lo}, {hi}) s</title>" in ttft
    tokens = c["Output tokens per shard"]
    assert "<title>run s0: 30</title>" in tokens and "<title>run s1: 70</title>" in tokens
    speed = c["Decode speed per shard"]
    assert "<title>run s0: 15.0</title>" in speed and "<title>run s1: 35.0</title>" in speed
    kpis = dict(re.findall(r'<div class="k">([^<]*)</div><div class="v">([^<]*)</div>', html))
    assert kpis == {
        "rows": "7",
        "errors": "3",
        "output tokens": "100",
        "acceptance rate": "0.704",
        "accept. length": "3.11",
        "e2e latency p50": "2.50 s",
        "TTFT p50": "0.25 s",
        "decode tok/s p50": "25.0",
    }
    shard_table = c["Per shard"]
    assert '<td class="l">s1</td><td class="r">4</td><td class="r">2</td>' in shard_table


def test_html_comparison_charts(out_a, out_b):
    a, b = load_output(out_a), load_output(out_b)
    html = render_html(compare(a, b), [a, b])
    assert_self_contained(html)
    assert html.count("<svg") == 7
    c = cards(html)
    # A's histogram in % of 27 steps, B's (4 6 5 18) of 33
    assert "<title>A 3: 51.9</title>" in c["Acceptance histogram"]
    assert "<title>B 3: 54.5</title>" in c["Acceptance histogram"]
    tokens = c["Output tokens per shard"]
    assert "<title>A s0: 30</title>" in tokens and "<title>A s1: 70</title>" in tokens
    assert "<title>B s0: 115</title>" in tokens and "<title>B s1:" not in tokens
    # two runs share bins (0..4 s by 0.25, A's e2e reach 4 s) and count in % of their
    # requests: B's e2e .2 .5 .5 1 1.5 2
    assert "<title>B: 2 requests in [0.5, 0.75) s</title>" in c["End-to-end latency"]
    assert c["Acceptance rate vs output length"].count("<circle") == 4 + 6
    assert '<div class="ratio">B/A 1.15x</div>' in html  # output tokens 115 / 100


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 3108) == [0, 1000, 2000, 3000, 4000]
    assert nice_ticks(1.8, 6.4, 6) == [1, 2, 3, 4, 5, 6, 7]
    assert nice_ticks(0, 4, 7) == [0, 1, 2, 3, 4]
    assert nice_ticks(5, 5)[0] <= 5 <= nice_ticks(5, 5)[-1]


# ---- command line ----------------------------------------------------------------------------


def test_cli(out_a, out_b, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["report", out_a])
    assert res.exit_code == 0, res.output
    shard_line = next(line for line in res.stdout.splitlines() if line.split()[:1] == ["s1"])
    assert shard_line.split() == [
        "s1",
        "4",
        "2",
        "70",
        "0.722",
        "3.17",
        "0.350",
        "3.500",
        "3.900",
        "35.0",
        "35.0",
    ]
    html = tmp_path / "r.html"
    res = runner.invoke(main, ["report", out_a, out_b, "--format", "json", "--html", str(html)])
    assert res.exit_code == 0, res.output
    parsed = json.loads(res.stdout)
    assert (parsed["matching"]["only_in_b"], parsed["matching"]["identical_text"]) == (1, 3)
    assert parsed["changes"]["output_tokens"]["delta"] == 15
    page = html.read_text()
    assert page.count("<svg") == 7 and "<title>B s0: 115</title>" in page
    res = runner.invoke(main, ["report", out_a, "--format", "markdown"])
    assert res.exit_code == 0
    assert "| s0 | 3 | 1 | 30 | 0.667 | 3.00 |" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give OUTPUT_PATH, or --job"),
        (["a", "b", "--job", "JOB"], "at most one OUTPUT_PATH"),
        (["a", "--storage-option", "novalue"], "--storage-option 'novalue': expected KEY=VALUE"),
        (["a", "--storage-option", "x..y=1"], "expected KEY=VALUE"),
    ],
)
def test_cli_bad_arguments_exit_2(tmp_path, out_a, args, message):
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "input": {"path": "in/*.parquet", "prompt_column": "p"},
                "output": {"path": out_a},
                "model": {"target": "m"},
            }
        )
    )
    args = [str(job) if a == "JOB" else out_a if a == "a" else a for a in args]
    res = CliRunner().invoke(main, ["report", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_cli_job_reads_its_output_path(tmp_path, out_a, out_b):
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "input": {"path": "in/*.parquet", "prompt_column": "p"},
                "output": {"path": "${OUT}"},
                "model": {"target": "m"},
            }
        )
    )
    res = CliRunner().invoke(main, ["report", "--job", str(job), "--format", "json"], env={"OUT": out_a})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["overall"]["output_tokens"] == 100
    # an OUTPUT_PATH beside --job is B, compared against the job's output
    res = CliRunner().invoke(
        main, ["report", "--job", str(job), out_b, "--format", "json"], env={"OUT": out_a}
    )
    assert res.exit_code == 0, res.output
    parsed = json.loads(res.stdout)
    assert (parsed["a"]["overall"]["output_tokens"], parsed["b"]["overall"]["output_tokens"]) == (100, 115)


def test_parse_storage_options():
    base = {"key": "k", "client_kwargs": {"region_name": "eu-west-1"}}
    got = parse_storage_options(
        [
            "client_kwargs.endpoint_url=http://127.0.0.1:9000",
            "use_ssl=false",
            "config_kwargs.retries={max_attempts: 3}",
            "secret=s:e=c",
        ],
        base,
    )
    assert got == {
        "key": "k",
        "secret": "s:e=c",
        "use_ssl": False,
        "client_kwargs": {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9000"},
        "config_kwargs": {"retries": {"max_attempts": 3}},
    }
    assert base == {"key": "k", "client_kwargs": {"region_name": "eu-west-1"}}  # not changed
    with pytest.raises(SpecError, match="key.sub: key holds str 'k', not a mapping"):
        parse_storage_options(["key.sub=1"], base)
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_storage_options(["a=[1"])


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p.mkdir() or p])
def test_cli_no_output_files_exits_3(tmp_path, make):
    path = make(tmp_path / "nothing")
    res = CliRunner().invoke(main, ["report", str(path)])
    assert res.exit_code == 3
    assert f"{path}: no output files" in res.output


def test_unreadable_file_exits_3(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 3 and f"{tmp_path}/bad.parquet: unreadable Parquet" in res.output


def test_not_an_output_file_exits_3(tmp_path):
    pq.write_table(pa.table({"request_id": ["r1"], "generated_text": ["x"]}), tmp_path / "p.parquet")
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 3
    assert f"{tmp_path}/p.parquet: column 'finish_reason' is missing" in res.output


# ---- object storage --------------------------------------------------------------------------

_buckets = itertools.count()


@pytest.fixture
def s3_output(s3_server, out_a, out_b):
    """Outputs A and B copied to a fresh bucket on the local S3 server; yields (bucket, options)."""
    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    bucket = f"report-{next(_buckets)}"
    fs.mkdir(bucket)
    for name, local in (("a", out_a), ("b", out_b)):
        for path in Path(local).rglob("*"):
            if path.is_file():
                fs.pipe(f"{bucket}/{name}/{path.relative_to(local).as_posix()}", path.read_bytes())
    yield bucket, options
    fs.rm(bucket, recursive=True)


def test_cli_reads_s3_with_storage_options(s3_output):
    bucket, options = s3_output
    args = [
        "--storage-option",
        f"key={options['key']}",
        "--storage-option",
        f"secret={options['secret']}",
        "--storage-option",
        f"client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}",
    ]
    res = CliRunner().invoke(main, ["report", f"s3://{bucket}/a", *args, "--format", "json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert (r["path"], r["files"], r["overall"]["rows"], r["overall"]["errors"]) == (
        f"s3://{bucket}/a",
        2,
        7,
        3,
    )
    assert r["overall"]["acceptance_rate"] == pytest.approx(57 / 81)
    assert r["overall"]["e2e_s"]["p90"] == pytest.approx(3.7)
    assert r["shards"]["s1"]["output_tokens"] == 70
    assert r["acceptance_per_position"]["accepted"] == [24, 19, 14]  # _batchspec/runs/ on S3
    res = CliRunner().invoke(
        main, ["report", f"s3://{bucket}/a", f"s3://{bucket}/b", *args, "--format", "json"]
    )
    assert res.exit_code == 0, res.output
    check_matching(json.loads(res.stdout)["matching"])


def test_cli_reads_s3_with_job(s3_output, tmp_path):
    bucket, options = s3_output
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "input": {"path": f"s3://{bucket}/in/*.parquet", "prompt_column": "p"},
                "output": {"path": f"s3://{bucket}/a", "storage_options": options},
                "model": {"target": "m"},
            }
        )
    )
    res = CliRunner().invoke(main, ["report", "--job", str(job), "--format", "markdown"])
    assert res.exit_code == 0, res.output
    assert f"# batchspec report: s3://{bucket}/a\n" in res.stdout
    assert "| s1 | 4 | 2 | 70 | 0.722 | 3.17 | 0.350 | 3.500 | 3.900 | 35.0 | 35.0 |" in res.stdout
    assert "| acceptance rate | 0.704  (57 accepted / 81 drafted) |" in res.stdout
    assert options["secret"] not in res.output


def test_s3_report_fetches_the_statistics_columns_only(s3_server, tmp_path, monkeypatch):
    """Projection reaches the network: s3fs's default read-ahead (blocks of 50 MiB) would
    download the generated_text chunks lying between the numeric ones of each row group."""
    import s3fs

    _, options = s3_server
    rnd = random.Random(0)
    rows = [
        ok(
            f"r{i}",
            "".join(rnd.choices(string.ascii_letters, k=1000)),
            10 + i % 7,
            0.1,
            1.0 + i % 5,
            10.0,
            (4, 12, i % 13, [1, 1, 1, 1]),
        )
        for i in range(4000)
    ]
    schema = SCHEMA.with_metadata({b"batchspec": json.dumps(META).encode()})
    local = tmp_path / "s0.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), local, row_group_size=500)
    meta = pq.ParquetFile(local).metadata
    text_bytes = sum(meta.row_group(g).column(2).total_compressed_size for g in range(meta.num_row_groups))
    assert meta.row_group(0).column(2).path_in_schema == "generated_text" and text_bytes > 1_000_000
    fs = s3fs.S3FileSystem(**options)
    bucket = f"report-{next(_buckets)}"
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/out/s0.parquet", local.read_bytes())

    fetched: list[int] = []
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        if method == "get_object":
            first, last = kwargs["Range"].split("=")[1].split("-")
            fetched.append(int(last) - int(first) + 1)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    r = build_report(f"s3://{bucket}/out", options)
    assert r["overall"]["rows"] == 4000
    assert r["overall"]["output_tokens"] == sum(10 + i % 7 for i in range(4000))
    assert 0 < sum(fetched) < text_bytes / 10, (sum(fetched), text_bytes)
    fs.rm(bucket, recursive=True)


def test_structured_valid_share_per_shard_and_old_files_without_the_column(tmp_path):
    """A shard written with the request-feature columns (structured_valid: 2 of 3 constrained
    rows valid, one row unconstrained) next to one written before they existed: the report
    gives 2/3 for the first, nothing for the second, and the old file still reads."""
    new_schema = pa.schema([*SCHEMA, ("sample_index", pa.int32()), ("structured_valid", pa.bool_())])
    rows = [ok(f"n{i}", "{}", 3, 0.1, 0.2, 10.0) for i in range(4)]
    for row, valid in zip(rows, [True, False, True, None], strict=True):
        row.update(sample_index=0, structured_valid=valid)
    path = write_output(tmp_path / "out", {"old": [ok("o1", "x", 3, 0.1, 0.2, 10.0)]})
    pq.write_table(
        pa.Table.from_pylist(rows, schema=new_schema).replace_schema_metadata(
            {"batchspec": json.dumps(META)}
        ),
        tmp_path / "out" / "new.parquet",
    )
    report = build_report(path)
    assert report["shards"]["new"]["structured_outputs"] == {"rows": 3, "valid": 2, "valid_share": 2 / 3}
    assert report["shards"]["old"]["structured_outputs"] is None
    assert report["overall"]["structured_outputs"]["valid"] == 2
    text = render(report, "table")
    assert "structured outputs valid" in text and "66.7%  (2 of 3 constrained rows)" in text


def test_a_reasoning_job_reports_thinking_and_answer_tokens_and_acceptance(tmp_path):
    from batchspec.columns import output_schema
    from batchspec.report.text import render_text

    schema = output_schema([]).with_metadata({b"batchspec": json.dumps({**META, "shard": "s0"}).encode()})
    rows = []
    for rid, thinking, answer, drafted, accepted, t_drafted, t_accepted in (
        ("r0", 30, 10, 40, 30, 28, 24),  # thinking: 24 of 28 accepted; answer: 6 of 12
        ("r1", 0, 20, 20, 8, 0, 0),  # enable_thinking: false
        ("r2", 40, 0, 50, 45, None, None),  # n > 1: vLLM records no steps, nothing is split
    ):
        row = dict.fromkeys(schema.names)
        row.update(
            request_id=rid,
            generated_text="answer",
            reasoning_text="thought" if thinking else None,
            finish_reason="stop",
            num_prompt_tokens=5,
            num_output_tokens=thinking + answer,
            num_reasoning_tokens=thinking,
            num_answer_tokens=answer,
            spec_num_steps=10,
            spec_num_draft_tokens=drafted,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_histogram=[0, 10],
            spec_reasoning_num_draft_tokens=t_drafted,
            spec_reasoning_num_accepted_tokens=t_accepted,
        )
        rows.append(row)
    (tmp_path / "out").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "out" / "s0.parquet")
    report = build_report(str(tmp_path / "out"))
    r = report["overall"]["reasoning"]
    assert (r["rows"], r["thinking_rows"], r["reasoning_tokens"], r["answer_tokens"]) == (3, 2, 70, 30)
    assert r["split_rows"] == 2  # the rates are of r0 and r1 alone
    assert r["reasoning_acceptance_rate"] == pytest.approx(24 / 28)
    assert r["answer_acceptance_rate"] == pytest.approx((38 - 24) / (60 - 28))
    text = render_text(report)
    assert "rows that thought" in text and "2 of 3" in text and "70 / 30" in text
    # a job without a reasoning parser has no such lines
    assert (
        build_report(write_output(tmp_path / "plain", {"s0": [ok("a", "x", 4, 0.1, 0.2, 20.0)]}))["overall"][
            "reasoning"
        ]
        is None
    )
