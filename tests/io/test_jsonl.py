"""JSON-lines input (batchspec/io/jsonl.py, batchspec/io/formats.py): formats from extensions or
``input.format``, output names, records streamed plain, gzip and zstd, a bad line a bad row that
names it, a bad file exit 3 before any engine; and a JSON-lines job on the real engine writing
what the same prompts as Parquet write."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.jobs import DRAFT, ENGINE, MODELS, read_output

from batchspec.errors import InputDataError, SpecError
from batchspec.io.formats import file_format, is_input_file, output_stem
from batchspec.io.jsonl import JsonLinesReader
from batchspec.io.listing import discover_shards
from batchspec.io.reader import ParquetReader, open_reader
from batchspec.io.records import FileFormat
from batchspec.spec.build import build_spec
from batchspec.spec.model import OutputSpec


def _spec(path, batch_rows: int = 1024, **input_keys):
    return build_spec(
        {
            "input": {"path": str(path), "prompt_column": "prompt", **input_keys},
            "output": {"path": "unused-out"},
            "model": {"target": "unused"},
            "execution": {"read_batch_rows": batch_rows},
        }
    )


def _write(path: Path, lines: list[str], compression: str | None = None) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        data = sink.getvalue().to_pybytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _reader(path: Path, batch_rows: int = 1024, **input_keys) -> JsonLinesReader | ParquetReader:
    spec = _spec(path, batch_rows, **input_keys)
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    return open_reader(shard, spec)


# ---------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("name", "declared", "expected"),
    [
        ("a.parquet", None, FileFormat("parquet")),
        ("a.jsonl", None, FileFormat("jsonl")),
        ("a.ndjson", None, FileFormat("jsonl")),
        ("a.JSONL.GZ", None, FileFormat("jsonl", "gzip")),
        ("a.jsonl.zst", None, FileFormat("jsonl", "zstd")),
        ("a.json", "jsonl", FileFormat("jsonl")),
        ("a.json.gz", "jsonl", FileFormat("jsonl", "gzip")),
        ("a.txt", "jsonl", FileFormat("jsonl")),
        ("a.data", "parquet", FileFormat("parquet")),
        # a name no format claims is Parquet, as every input was before JSON lines
        ("a.json", None, FileFormat("parquet")),
        ("a.txt", None, FileFormat("parquet")),
        ("a", None, FileFormat("parquet")),
    ],
)
def test_a_files_format_comes_from_input_format_or_its_extension(name, declared, expected):
    assert file_format(f"s3://b/in/{name}", declared) == expected


@pytest.mark.parametrize(
    ("name", "declared"), [("a.json.gz", None), ("a.parquet.gz", None), ("a.csv.zst", "parquet")]
)
def test_a_compressed_file_read_as_parquet_is_a_spec_error_naming_input_format(name, declared):
    with pytest.raises(SpecError) as err:
        file_format(f"s3://user:secret@b/in/{name}", declared)
    assert err.value.key == "input.format" and err.value.exit_code == 2
    assert "secret" not in str(err.value)


def test_output_names_drop_the_formats_extensions_and_parquets_stay_as_they_were():
    jsonl, gz, parquet = FileFormat("jsonl"), FileFormat("jsonl", "gzip"), FileFormat("parquet")
    assert output_stem("day=1/part-0.jsonl.gz", gz) == "day=1/part-0"
    assert output_stem("part-0.ndjson", jsonl) == "part-0"
    assert output_stem("part-0.json", jsonl) == "part-0"
    assert output_stem("part-0.txt", jsonl) == "part-0.txt"
    assert output_stem("part-0.parquet", parquet) == "part-0"
    assert output_stem("part-0.pq", parquet) == "part-0.pq"  # named as before JSON lines existed


def test_a_directory_lists_the_files_of_its_format(tmp_path):
    for name in ("a.parquet", "b.jsonl", "c.jsonl.gz", "d.json", "e.txt", "f.parquet.gz"):
        (tmp_path / name).write_bytes(b"")
    found = {p.name for p in tmp_path.iterdir() if is_input_file(str(p), None)}
    assert found == {"a.parquet", "b.jsonl", "c.jsonl.gz"}
    assert {p.name for p in tmp_path.iterdir() if is_input_file(str(p), "jsonl")} == {
        "b.jsonl",
        "c.jsonl.gz",
        "d.json",
    }
    assert {p.name for p in tmp_path.iterdir() if is_input_file(str(p), "parquet")} == {"a.parquet"}


def test_input_format_is_checked_and_a_jsonl_and_a_parquet_of_one_name_clash(tmp_path):
    with pytest.raises(SpecError) as err:
        _spec(tmp_path / "*.jsonl", format="csv")
    assert err.value.key == "input.format"
    _write(tmp_path / "in" / "a.jsonl", [json.dumps({"prompt": "x"})])
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in" / "a.parquet")
    with pytest.raises(SpecError, match="two input files map to one output name 'a'"):
        discover_shards([str(tmp_path / "in" / "*")], {})


# ---------------------------------------------------------------------------- reading


LINES = [json.dumps({"id": i, "prompt": f"def f{i}(x):", "meta": {"n": i}, "score": i / 2}) for i in range(4)]


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_records_stream_with_their_kept_columns_typed_from_the_first_ones(tmp_path, compression, monkeypatch):
    from batchspec.io import jsonl

    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 7)  # lines cut across reads
    suffix = {None: "", "gzip": ".gz", "zstd": ".zst"}[compression]
    reader = _reader(_write(tmp_path / f"p.jsonl{suffix}", ["", *LINES, "  "], compression), id_column="id")
    assert isinstance(reader, JsonLinesReader) and reader.num_rows == 4
    assert {f.name: str(f.type) for f in reader.kept_fields} == {
        "id": "int64",
        "meta": "struct<n: int64>",
        "score": "double",
    }
    rows = list(reader.rows())
    assert [(r.request_id, r.prompt, r.error) for r in rows] == [
        (str(i), f"def f{i}(x):", None) for i in range(4)
    ]
    assert rows[3].kept == {"id": 3, "meta": {"n": 3}, "score": 1.5}


def test_each_bad_line_is_an_error_row_naming_its_line_and_the_rest_run(tmp_path):
    lines = [
        LINES[0],
        "not json {",
        json.dumps([1, 2]),
        json.dumps({"id": 9, "prompt": 7}),
        json.dumps({"id": 10, "prompt": "x", "score": "high"}),
        json.dumps({"id": 11}),
        json.dumps({"id": None, "prompt": "y"}),
        json.dumps({"id": 13, "prompt": "  "}),
        b"\xff\xfe".decode("latin-1"),
        LINES[1],
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8").replace("ÿþ".encode(), b"\xff\xfe"))
    rows = list(_reader(path, batch_rows=2, id_column="id").rows())
    errors = [r.error for r in rows]
    assert errors[0] is None and errors[-1] is None
    assert errors[1].startswith("not JSON: line 2 (")
    assert errors[2] == "not an object: line 3 is a JSON list"
    assert errors[3] == "prompt is no text: line 4 has a JSON int"
    assert errors[4] == (
        "kept key of another type: line 5, 'score' is a str where the first records have double"
    )
    assert errors[5] == "no prompt key: line 6 has no 'prompt'"
    assert errors[6] == "null id: line 7, key 'id'"
    assert errors[7] == "empty prompt: line 8"
    assert errors[8] == "not UTF-8: line 9"
    # a row without a usable id gets the shard/index one, as a Parquet row does
    assert [r.request_id for r in rows][1:3] == ["bad/1", "bad/2"]


def test_chat_messages_lora_and_sampling_keys_are_read_as_parquet_columns_are(tmp_path):
    good = [{"role": "user", "content": "def mean(xs):"}]
    lines = [
        json.dumps({"m": good, "t": 0.5, "adapter": "upper"}),
        json.dumps({"m": good}),
        json.dumps({"m": "just text"}),
        json.dumps({"m": [{"role": "user"}]}),
        json.dumps({"m": good, "adapter": 3}),
    ]
    spec = build_spec(
        {
            "input": {
                "path": str(_write(tmp_path / "c.jsonl", lines)),
                "messages_column": "m",
                "lora_column": "adapter",
                "sampling_columns": {"temperature": "t"},
            },
            "output": {"path": "unused-out"},
            "model": {"target": "unused", "lora": {"adapters": {"upper": "unused"}}},
            "execution": {"read_batch_rows": 4},
        }
    )
    [shard] = discover_shards(spec.input.paths, {})
    rows = list(open_reader(shard, spec).rows())
    assert rows[0].messages == good and rows[0].overrides == {"temperature": 0.5}
    assert rows[0].lora == "upper" and rows[0].error is None
    assert rows[1].overrides == {} and rows[1].lora is None and rows[1].error is None
    assert rows[2].error == "bad messages: line 3 has no list of {role, content} objects"
    assert rows[3].error == "message 0 has no text content: line 4"
    assert rows[4].error == "adapter name is no text: line 5, 'adapter' is a JSON int"


def test_a_bad_file_is_bad_input_data_naming_the_shard(tmp_path, monkeypatch):
    from batchspec.io import jsonl

    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 64)
    no_prompt = _write(tmp_path / "a" / "x.jsonl", [json.dumps({"text": "hi"})])
    with pytest.raises(InputDataError, match=r"x\.jsonl: no prompt key 'prompt' .*keys: text") as err:
        _reader(no_prompt)
    assert err.value.exit_code == 3
    mixed = _write(
        tmp_path / "b" / "y.jsonl",
        [json.dumps({"prompt": "a", "k": 1}), json.dumps({"prompt": "b", "k": "one"})],
    )
    with pytest.raises(InputDataError, match=r"y\.jsonl: key 'k' has values of several types"):
        _reader(mixed)
    torn = tmp_path / "c" / "z.jsonl.gz"
    torn.parent.mkdir()
    torn.write_bytes(gzip.compress(("\n".join(LINES * 200)).encode())[:-200])
    reader = _reader(torn, batch_rows=2)  # its first records read fine
    with pytest.raises(InputDataError, match=r"z\.jsonl\.gz: cannot read the file") as err:
        assert reader.num_rows is None  # never reached: counting reads the torn end
    assert err.value.exit_code == 3


@pytest.mark.vllm
def test_a_torn_jsonl_shard_ends_the_run_before_any_engine_or_is_skipped(tmp_path, monkeypatch):
    """The check stage reads every JSON-lines shard whole (to count it): a gzip file cut short
    is found there, its first records readable or not: exit 3 naming it before any row reaches
    an engine, or, with on_bad_shard: skip, left out while the good shard commits."""
    from helpers.fakes import FakeEngine
    from helpers.shared_engines import NoEngine, run_library

    from batchspec.io import jsonl

    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 64)  # the torn file's first records read fine
    _write(tmp_path / "in" / "a.jsonl", LINES)
    torn = tmp_path / "in" / "b.jsonl.gz"
    torn.write_bytes(gzip.compress(("\n".join(LINES * 200)).encode())[:-200])
    raw = {
        "input": {"path": str(tmp_path / "in" / "*"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
    }
    failed = run_library(build_spec(raw), NoEngine())
    assert failed.exit_code == 3 and "b.jsonl.gz: cannot read the file after line" in str(failed.error)
    assert not list((tmp_path / "out").glob("*.parquet"))
    raw["input"]["on_bad_shard"] = "skip"
    skipped = run_library(build_spec(raw), FakeEngine())
    assert skipped.exit_code == 0, skipped.log[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.parquet")) == ["a.parquet"]
    assert list(skipped.summary["bad_shards"]) == ["b"]


# ---------------------------------------------------------------------------- no line stops a run

#: A line nested 5,000 deep: json's parser raises RecursionError on it.
DEEP = "[" * 5000 + "]" * 5000


def _nested(depth: int) -> str:
    """A record whose prompt is fine and whose ``k`` makes the line nest ``depth`` deep."""
    return json.dumps({"prompt": "p", "k": 0}).replace(
        "0}", "[" * (depth - 1) + "0" + "]" * (depth - 1) + "}"
    )


@pytest.mark.parametrize("where", ["among the first records", "after them"])
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_a_line_nested_5000_deep_is_an_error_row_where_the_columns_are_read_or_later(
    tmp_path, where, compression
):
    """The reader's first records (which settle the columns, in the check stage), its count and
    its rows all read past a line json's parser would recurse on: one error row naming it."""
    from batchspec.io.jsonl import MAX_JSON_DEPTH

    before = 1 if where == "among the first records" else 5
    good = [json.dumps({"prompt": f"p{i}"}) for i in range(7)]
    lines = [
        *good[:before],
        DEEP,
        '{"prompt": ' + DEEP + "}",
        _nested(MAX_JSON_DEPTH),
        _nested(MAX_JSON_DEPTH + 1),
        json.dumps({"prompt": "wide", "k": [[]] * 500}),
        *good[before:],
    ]
    suffix = {None: "", "gzip": ".gz"}[compression]
    spec = _spec(_write(tmp_path / f"deep.jsonl{suffix}", lines, compression), batch_rows=3)
    [shard] = discover_shards(spec.input.paths, {})
    # no kept keys: the lines that nest do so under "k", which none of the others has
    reader = JsonLinesReader(shard, spec.input, OutputSpec(path="o", keep_columns=()), 3)
    assert reader.num_rows == len(lines)
    rows = list(reader.rows())
    errors = {i + 1: r.error for i, r in enumerate(rows) if r.error}
    deep = f"nests more than {MAX_JSON_DEPTH} arrays and objects"
    assert errors == {
        before + 1: f"too deep: line {before + 1} {deep}",
        before + 2: f"too deep: line {before + 2} {deep}",
        before + 4: f"too deep: line {before + 4} {deep}",
    }
    # MAX_JSON_DEPTH itself is read, as is a line of many brackets that nests 2 deep
    assert [r.prompt for r in rows if r.error is None] == [
        *[f"p{i}" for i in range(before)],
        "p",
        "wide",
        *[f"p{i}" for i in range(before, 7)],
    ]


@pytest.mark.vllm
def test_a_run_reads_past_a_deep_line_in_its_first_records(tmp_path):
    """The check stage reads a JSON-lines shard's first records and counts its lines: a line
    nested 5,000 deep among them is one error row of a run that exits 0."""
    from helpers.fakes import FakeEngine
    from helpers.shared_engines import run_library

    _write(tmp_path / "in" / "a.jsonl", [DEEP, *LINES])
    raw = {
        "input": {"path": str(tmp_path / "in" / "*"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "execution": {"read_batch_rows": 2},
    }
    done = run_library(build_spec(raw), FakeEngine())
    assert done.error is None, done.log[-2000:]
    out = read_output(tmp_path / "out").to_pylist()
    assert len(out) == 5
    assert [r["error"] for r in out if r["finish_reason"] == "error"] == [
        "too deep: line 1 nests more than 48 arrays and objects"
    ]


def test_any_error_making_a_row_is_that_rows_error_naming_the_line(tmp_path, monkeypatch):
    from batchspec.io import jsonl

    def broken(row, messages):
        raise RuntimeError("a check that raised")

    monkeypatch.setattr(jsonl, "set_messages", broken)
    good = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path / "c.jsonl", [json.dumps({"m": good}), json.dumps({"m": "text"})])
    rows = list(_reader(path, messages_column="m", prompt_column=None).rows())
    assert [r.error for r in rows] == [
        "unreadable line: line 1 (RuntimeError: a check that raised)",
        "bad messages: line 2 has no list of {role, content} objects",
    ]
    assert rows[0].request_id == "c/0"


@pytest.mark.vllm
def test_a_lone_surrogate_escape_is_an_error_row_and_a_pair_is_text(tmp_path):
    """``"\\ud800"`` parses to a string no UTF-8 file holds: it would fail the run where the row
    is written or its id digested; an escaped pair is one character."""
    from helpers.fakes import FakeEngine
    from helpers.shared_engines import run_library

    _write(
        tmp_path / "in" / "s.jsonl",
        [
            '{"id": "a", "prompt": "x \\ud800"}',
            '{"id": "b\\uDC00", "prompt": "y"}',
            '{"id": "c", "prompt": "\\ud83d\\ude00"}',
        ],
    )
    raw = {
        "input": {"path": str(tmp_path / "in" / "*"), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
    }
    done = run_library(build_spec(raw), FakeEngine())
    assert done.error is None, done.log[-2000:]
    out = read_output(tmp_path / "out").to_pylist()
    assert [(r["request_id"], r["error"]) for r in out] == [
        ("s/0", "not UTF-8: line 1 escapes half a surrogate pair"),
        ("s/1", "not UTF-8: line 2 escapes half a surrogate pair"),
        ("c", None),
    ]


# ---------------------------------------------------------------------------- input.max_line_bytes


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_a_line_over_max_line_bytes_is_one_error_row_and_the_next_line_reads(
    tmp_path, compression, monkeypatch
):
    from batchspec.io import jsonl

    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 7)  # the long lines span many reads
    at_cap = json.dumps({"prompt": "x" * 80})
    cap = len(at_cap)
    lines = [
        LINES[0],
        json.dumps({"prompt": "y" * 500}),
        LINES[1],
        " " * 300,
        at_cap,
        json.dumps({"prompt": "z" * (cap - 15)}) + "  ",
        LINES[2],
    ]
    suffix = {None: "", "gzip": ".gz", "zstd": ".zst"}[compression]
    path = _write(tmp_path / f"long.jsonl{suffix}", lines, compression)
    reader = _reader(path, batch_rows=2, max_line_bytes=cap)
    assert reader.num_rows == 6  # the blank line of 300 spaces is no record, however long
    rows = list(reader.rows())
    assert [r.error for r in rows] == [
        None,
        f"line too long: line 2 has 514 bytes, more than input.max_line_bytes ({cap})",
        None,
        None,
        f"line too long: line 6 has {cap + 1} bytes, more than input.max_line_bytes ({cap})",
        None,
    ]
    assert [r.prompt for r in rows] == ["def f0(x):", None, "def f1(x):", "x" * 80, None, "def f2(x):"]


def test_a_long_line_is_read_past_in_constant_memory(monkeypatch):
    """64 MiB of one line over a 1 MiB cap: what the reader holds stays within a few chunks
    (the line is never gathered), and the lines around it come whole."""
    import tracemalloc

    from batchspec.io import jsonl

    class Stream:  # a line of 64 one-MiB chunks between two short lines, never all in memory
        def __init__(self):
            self.reads = 0

        def read(self, n):
            self.reads += 1
            if self.reads == 1:
                return b"first\n" + b"x" * (n - 6)
            if self.reads <= 64:
                return b"x" * n
            return b"\nlast\n" if self.reads == 65 else b""

    tracemalloc.start()
    try:
        lines = [x if isinstance(x, bytes) else x.size for x in jsonl._lines(Stream(), 2**20)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lines == [b"first", 64 * 2**20 - 6, b"last"]
    assert peak < 5 * jsonl.CHUNK_BYTES, f"{peak / 2**20:.1f} MiB held"


@pytest.mark.parametrize("value", [0, -1, 1.5, "64MiB", True])
def test_a_bad_max_line_bytes_is_a_spec_error_naming_the_key(value):
    with pytest.raises(SpecError) as err:
        _spec("in.jsonl", max_line_bytes=value)
    assert err.value.key == "input.max_line_bytes" and err.value.exit_code == 2
    assert "integer" in str(err.value)


def test_max_line_bytes_defaults_to_64_mib():
    assert _spec("in.jsonl").input.max_line_bytes == 64 * 2**20


# ---------------------------------------------------------------------------- on the real engine


@pytest.mark.engine
def test_a_jsonl_job_writes_what_the_same_prompts_as_parquet_write(tmp_path, shared_engines):
    """The same 12 prompts as a gzip JSON-lines file (with two bad lines among them) and as
    Parquet, greedy with a draft model: the same text per id, the JSON-lines output named after
    its input, the bad lines error rows naming their lines, `validate` counting them."""
    from demo_data import prompt_table

    from batchspec.run.validate import validate_job

    table = prompt_table(12, seed=41).drop_columns(["max_tokens"])
    records = table.to_pylist()
    lines = [json.dumps(r) for r in records]
    lines[3:3] = ["{oops", json.dumps({"id": "no-prompt"})]
    _write(tmp_path / "jsonl" / "day=1" / "part-0.jsonl.gz", lines, "gzip")
    pq.write_table(table, tmp_path / "parquet.parquet")
    outputs = {}
    for name, path in (
        ("jsonl", tmp_path / "jsonl" / "**" / "*.jsonl.gz"),
        ("parquet", tmp_path / "parquet.parquet"),
    ):
        spec = build_spec(
            {
                "name": f"jsonl-{name}",
                "input": {"path": str(path), "prompt_column": "prompt", "id_column": "id"},
                "output": {"path": str(tmp_path / f"out-{name}")},
                "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)},
                "speculative": dict(DRAFT),
                "sampling": {"temperature": 0.0, "max_tokens": 16},
            }
        )
        if name == "jsonl":
            report = validate_job(spec)
            [check] = report.shards
            assert check.rows == 14 and check.bad_rows == {"not JSON": 1, "no prompt key": 1}
        run = shared_engines.run(spec)
        assert run.exit_code == 0, run.log[-3000:]
    assert [
        p.relative_to(tmp_path / "out-jsonl").as_posix()
        for p in (tmp_path / "out-jsonl").rglob("*.parquet")
        if "_batchspec" not in p.parts
    ] == ["day=1/part-0.parquet"]
    outputs["jsonl"] = pq.read_table(tmp_path / "out-jsonl" / "day=1" / "part-0.parquet")
    outputs["parquet"] = read_output(tmp_path / "out-parquet")
    jsonl = {r["request_id"]: r for r in outputs["jsonl"].to_pylist()}
    parquet = {r["request_id"]: r for r in outputs["parquet"].to_pylist()}
    assert {k: v["generated_text"] for k, v in jsonl.items() if k in parquet} == {
        k: v["generated_text"] for k, v in parquet.items()
    }
    bad = {
        v["request_id"]: v["error"].split(" (")[0] for v in jsonl.values() if v["finish_reason"] == "error"
    }
    assert bad == {"day=1/part-0/3": "not JSON: line 4", "no-prompt": "no prompt key: line 5 has no 'prompt'"}
    assert all(v["spec_num_draft_tokens"] is not None for k, v in jsonl.items() if k in parquet)
