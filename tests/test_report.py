"""`batchspec report` on small outputs written by hand: numbers checked against hand computation.

No engine: the output files are built with pyarrow from batchspec's own output schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchspec.cli import main
from batchspec.columns import empty_result, error_result, output_schema
from batchspec.html_report import nice_ticks, render_html
from batchspec.report import build_comparison, build_report, compare, load_output, render, summarize
from batchspec.sink import METADATA_KEY

RUN_ID = "20260101T000000Z-aaaaaa"
META = {"run_id": RUN_ID, "job": "t", "target_model": "tgt", "draft_model": "dft",
        "speculative_method": "draft_model", "vllm_version": "0.32.0", "batchspec_version": "0.1.0",
        "spec": {"speculative": {"method": "draft_model", "num_speculative_tokens": 3}}}
KEPT = [pa.field("topic", pa.string())]


def ok(rid: str, text: str, out: int, ttft: float, e2e: float, tps: float,
       spec: tuple[int, int, int, list[int]] | None = None) -> dict:
    """A successful row; ``spec`` = (steps, drafted, accepted, histogram) or None (spec off)."""
    row = {**empty_result(), "request_id": rid, "topic": "x", "generated_text": text,
           "finish_reason": "length", "num_prompt_tokens": 5, "num_output_tokens": out,
           "time_queued_s": 0.0, "time_to_first_token_s": ttft, "time_decode_s": e2e - ttft,
           "time_e2e_s": e2e, "output_tokens_per_s": tps}
    if spec:
        steps, drafted, accepted, hist = spec
        row.update(spec_num_steps=steps, spec_num_draft_tokens=drafted,
                   spec_num_accepted_tokens=accepted, spec_acceptance_rate=accepted / drafted,
                   spec_mean_acceptance_length=1 + accepted / steps, spec_acceptance_histogram=hist)
    return row


def failed(rid: str, message: str) -> dict:
    return {**error_result(message, 5), "request_id": rid, "topic": "x"}


def write_output(root: Path, shards: dict[str, list[dict]], meta: dict = META,
                 runs: list[dict] = ()) -> str:
    """An output directory as the runner leaves it: one file per shard, run summaries."""
    for name, rows in shards.items():
        schema = output_schema(KEPT).with_metadata(
            {METADATA_KEY: json.dumps({**meta, "shard": name}).encode()})
        root.mkdir(parents=True, exist_ok=True)
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
    "s0": [ok("r1", "a", 10, 0.1, 1.0, 10.0, (4, 12, 6, [1, 1, 1, 1])),
           ok("r2", "b", 20, 0.2, 2.0, 20.0, (5, 15, 12, [0, 1, 1, 3])),
           failed("r3", "prompt too long: 600 tokens > 512")],
    "s1": [ok("r4", "c", 30, 0.3, 3.0, 30.0, (10, 30, 15, [2, 3, 3, 2])),
           ok("r5", "d", 40, 0.4, 4.0, 40.0, (8, 24, 24, [0, 0, 0, 8])),
           failed("r6", "empty prompt"),
           failed("r7", "prompt too long: 700 tokens > 512")],
}
RUNS = [{"run_id": RUN_ID, "acceptance_per_position": {"num_drafts": 27, "accepted": [24, 19, 14]}},
        # another output's run: its counters are not this output's
        {"run_id": "20250101T000000Z-other", "acceptance_per_position": {"num_drafts": 5,
                                                                         "accepted": [5, 5, 5]}}]


@pytest.fixture
def out_a(tmp_path) -> str:
    return write_output(tmp_path / "a", A_SHARDS, runs=RUNS)


@pytest.fixture
def out_b(tmp_path) -> str:
    rows = [ok("r1", "a", 10, 0.1, 0.5, 20.0, (4, 12, 7, [1, 1, 0, 2])),        # rate 0.5 -> 7/12
            ok("r1", "dup", 10, 0.1, 0.5, 20.0, (4, 12, 12, [0, 0, 0, 4])),     # duplicate id
            ok("r2", "changed", 20, 0.2, 1.0, 40.0, (5, 15, 12, [0, 1, 1, 3])),  # rate 0.8 -> 0.8
            ok("r4", "c", 30, 0.3, 1.5, 60.0, (10, 30, 12, [2, 4, 4, 0])),      # rate 0.5 -> 0.4
            ok("r5", "d", 40, 0.4, 2.0, 80.0, (8, 24, 24, [0, 0, 0, 8])),       # rate 1.0 -> 1.0
            failed("r6", "empty prompt"),
            ok("r8", "new", 5, 0.1, 0.2, 50.0, (2, 6, 3, [1, 0, 0, 1]))]
    return write_output(tmp_path / "b", {"s0": rows})


@pytest.fixture
def out_off(tmp_path) -> str:
    meta = {**META, "draft_model": None, "speculative_method": None, "spec": {"speculative": None}}
    rows = [ok("r1", "a", 10, 0.1, 1.0, 10.0), ok("r2", "b", 20, 0.2, 2.0, 20.0), failed("r3", "x: y")]
    return write_output(tmp_path / "off", {"s0": rows}, meta=meta)


def test_numbers_match_hand_computation(out_a):
    r = build_report(out_a)
    m = r["overall"]
    assert (r["files"], m["rows"], m["errors"]) == (2, 7, 3)
    assert m["errors_by_reason"] == {"empty prompt": 1, "prompt too long": 2}
    assert m["finish_reasons"] == {"error": 3, "length": 4}
    assert m["output_tokens"] == 100
    assert (m["spec_num_steps"], m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"]) == (27, 81, 57)
    assert m["acceptance_rate"] == pytest.approx(57 / 81)  # sum / sum, not a mean of rates
    assert m["mean_acceptance_length"] == pytest.approx(1 + 57 / 27)
    assert m["acceptance_histogram"] == [3, 5, 5, 14]
    # per-request rates 0.5, 0.8, 0.5, 1.0 -> sorted 0.5 0.5 0.8 1.0; linear interpolation at
    # position (n - 1) * p: p50 at 1.5 -> 0.65, p90 at 2.7 -> 0.8 + 0.7 * 0.2
    rate = m["acceptance_rate_per_request"]
    assert rate["count"] == 4
    assert rate["mean"] == pytest.approx(0.7)
    assert rate["p50"] == pytest.approx(0.65)
    assert rate["p90"] == pytest.approx(0.94)
    # e2e 1, 2, 3, 4 (failed rows have no timings): p50 2.5, p90 3.7, p99 3.97
    assert [m["e2e_s"][p] for p in ("p50", "p90", "p99")] == pytest.approx([2.5, 3.7, 3.97])
    assert [m["ttft_s"][p] for p in ("p50", "p90")] == pytest.approx([0.25, 0.37])
    assert (m["decode_tokens_per_s"]["mean"], m["decode_tokens_per_s"]["p50"]) == pytest.approx((25, 25))

    s0 = r["shards"]["s0"]
    assert (s0["rows"], s0["errors"], s0["output_tokens"], s0["run_id"]) == (3, 1, 30, RUN_ID)
    assert s0["acceptance_rate"] == pytest.approx(18 / 27)
    assert s0["e2e_s"]["p50"] == pytest.approx(1.5)
    assert r["shards"]["s1"]["errors_by_reason"] == {"empty prompt": 1, "prompt too long": 1}

    lin = r["lineage"]
    assert lin["run_id"] == [RUN_ID] and lin["target_model"] == ["tgt"]
    assert lin["draft_model"] == ["dft"] and lin["num_speculative_tokens"] == [3]
    assert lin["vllm_version"] == ["0.32.0"] and lin["batchspec_version"] == ["0.1.0"]
    pos = r["acceptance_per_position"]
    assert pos["runs"] == [RUN_ID] and pos["accepted"] == [24, 19, 14]
    assert pos["rate"] == pytest.approx([24 / 27, 19 / 27, 14 / 27])


def test_formats(out_a):
    r = build_report(out_a)
    parsed = json.loads(render(r, "json"))
    assert parsed["overall"]["acceptance_histogram"] == [3, 5, 5, 14]
    md = render(r, "markdown")
    assert "| s0 | 3 | 1 | 30 | 0.667 |" in md
    assert "|:---|---:|" in md
    text = render(r, "table")
    assert "prompt too long" in text and "0.704" in text  # 57 / 81


def test_speculation_off_is_null_not_zero(out_off):
    r = build_report(out_off)
    m = r["overall"]
    assert m["speculative"] is False
    assert m["acceptance_rate"] is None and m["spec_num_draft_tokens"] is None
    assert m["acceptance_histogram"] is None and m["acceptance_rate_per_request"] is None
    assert m["e2e_s"]["p50"] == pytest.approx(1.5)
    assert m["errors_by_reason"] == {"x": 1}
    for fmt in ("table", "markdown", "json"):
        render(r, fmt)
    assert "speculative decoding was off" in render(r, "table")
    html = render_html(r, [load_output(out_off)])
    assert "Speculative decoding was off" in html


def test_compare_matches_by_request_id(out_a, out_b):
    c = build_comparison(out_a, out_b)
    mt = c["matching"]
    assert (mt["matched"], mt["only_in_a"], mt["only_in_b"]) == (5, 2, 1)  # r3, r7 | r8
    assert (mt["duplicate_ids_a"], mt["duplicate_ids_b"]) == (0, 1)
    assert (mt["both_ok"], mt["identical_text"]) == (4, 3)  # r2's text changed
    d = mt["acceptance_rate_diff"]
    assert d["count"] == 4
    assert d["mean"] == pytest.approx((7 / 12 - 0.5 + 0 + (0.4 - 0.5) + 0) / 4)
    assert (d["b_higher"], d["a_higher"], d["equal"]) == (1, 1, 2)
    ch = c["changes"]
    assert (ch["rows"]["a"], ch["rows"]["b"], ch["rows"]["delta"]) == (7, 7, 0)
    # B counts every row, its duplicate too: e2e .2 .5 .5 1 1.5 2 -> p50 at 2.5 = 0.75
    assert ch["e2e_s.p50"]["ratio"] == pytest.approx(0.75 / 2.5)
    text = render(c, "table")
    assert "only in A" in text and "B / A" in text
    assert "| only in B | 1 |" in render(c, "markdown")
    json.loads(render(c, "json"))


def test_compare_with_speculation_off(out_a, out_off):
    c = build_comparison(out_a, out_off)
    assert c["matching"]["acceptance_rate_diff"] is None
    assert c["changes"]["acceptance_rate"]["b"] is None and c["changes"]["acceptance_rate"]["ratio"] is None
    render(c, "table")
    html = render_html(c, [load_output(out_a), load_output(out_off)])
    assert "B: speculative decoding was off" in html  # the charts say whose data is missing


def test_html_is_self_contained_with_a_chart_each(out_a, out_b):
    a = load_output(out_a)
    html = render_html(summarize(a), [a])
    # histogram, per position, scatter, e2e, TTFT, tokens per shard, speed per shard
    assert html.count("<svg") == 7
    assert "<script" not in html and "<link" not in html and 'src="' not in html
    b = load_output(out_b)
    assert render_html(compare(a, b), [a, b]).count("<svg") == 7


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 3108) == [0, 1000, 2000, 3000, 4000]
    assert nice_ticks(1.8, 6.4, 6) == [1, 2, 3, 4, 5, 6, 7]
    assert nice_ticks(5, 5)[0] <= 5 <= nice_ticks(5, 5)[-1]


def test_cli(out_a, out_b, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["report", out_a])
    assert res.exit_code == 0, res.output
    assert "Per shard" in res.output
    html = tmp_path / "r.html"
    res = runner.invoke(main, ["report", out_a, out_b, "--format", "json", "--html", str(html)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["matching"]["only_in_b"] == 1
    assert html.read_text().count("<svg") == 7
    res = runner.invoke(main, ["report", out_a, "--format", "markdown"])
    assert res.exit_code == 0 and res.output.startswith("# batchspec report")


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p.mkdir() or p])
def test_cli_no_output_files_exits_3(tmp_path, make):
    path = make(tmp_path / "nothing")
    res = CliRunner().invoke(main, ["report", str(path)])
    assert res.exit_code == 3
    assert str(path) in res.output


def test_unreadable_file_exits_3(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 3 and "bad.parquet" in res.output


def test_reads_through_fsspec(out_a):
    """Any fsspec URL works (s3:// in production); memory:// stands in for an object store."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in Path(out_a).rglob("*"):
        if path.is_file():
            fs.pipe(f"/fsspec-out/{path.relative_to(out_a).as_posix()}", path.read_bytes())
    try:
        r = build_report("memory://fsspec-out")
        assert (r["files"], r["overall"]["rows"]) == (2, 7)
        assert r["acceptance_per_position"]["accepted"] == [24, 19, 14]
    finally:
        fs.rm("/fsspec-out", recursive=True)
