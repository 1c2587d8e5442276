"""Write containment (batchspec/io/contained.py): a table's log or manifest never steers a read
or a write outside the table, and nothing batchspec writes lands outside ``output.path``,
whatever made the name. Delta and Iceberg, input and output, on local disk; the S3 server's
cases are in tests/io/test_tables_s3.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import run
from helpers.tables import iceberg_catalog, make_input, run_table_cli, table_job, write_job

from batchspec.errors import InputDataError
from batchspec.io.contained import plain_relative, table_relative
from batchspec.io.output_dir import OutputDir
from batchspec.io.output_formats import OUTPUT_FORMATS
from batchspec.io.records import Shard
from batchspec.spec.build import build_spec

pytestmark = pytest.mark.vllm

#: Names that are not plain relative names, each spelled as a log or a listing could give it.
ESCAPES = [
    "../victim/data",
    "a/../../victim",
    "/tmp/victim/data",
    "s3://other-bucket/victim",
    "a//b",
    "./a",
    "a/.",
    "a\x00b",
    "",
]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_name_that_is_not_plain_and_relative_is_refused(name):
    assert plain_relative(name) is not None


@pytest.mark.parametrize("name", ["part-0", "day=1/part-0", "a..b/c.d", "x~y", "name with spaces"])
def test_plain_relative_names_pass(name):
    assert plain_relative(name) is None


@pytest.mark.parametrize(
    ("root", "path", "relative"),
    [
        ("/t/in", "part-0.parquet", "part-0.parquet"),
        ("/t/in", "day%3D1/part-0.parquet", "day=1/part-0.parquet"),
        ("/t/in", "/t/in/part-0.parquet", "part-0.parquet"),
        ("/t/in", "file:///t/in/part-0.parquet", "part-0.parquet"),
        ("file:///t/in", "/t/in/data/x.parquet", "data/x.parquet"),
        ("s3://b/wh/t", "s3://b/wh/t/data/x.parquet", "data/x.parquet"),
        ("s3://b/wh/t", "data/x.parquet", "data/x.parquet"),
    ],
)
def test_a_table_file_below_its_root_is_named_relative_to_it(root, path, relative):
    assert table_relative(root, path) == (relative, None)


@pytest.mark.parametrize(
    ("root", "path"),
    [
        ("/t/in", "../victim/data.parquet"),
        ("/t/in", "..%2Fvictim%2Fdata.parquet"),
        ("/t/in", "/t/in/../victim/data.parquet"),
        ("/t/in", "/t/victim/data.parquet"),
        ("/t/in", "file:///t/victim/data.parquet"),
        ("/t/in", "data%00.parquet"),
        ("/t/in", "s3://other/data.parquet"),
        ("s3://b/wh/t", "s3://b/wh/t/../../victim.parquet"),
        ("s3://b/wh/t", "s3://other/wh/t/data/x.parquet"),
        ("s3://b/wh/t", "gs://b/wh/t/data/x.parquet"),
        ("s3://b/wh/t", "/b/wh/t/data/x.parquet"),
    ],
)
def test_a_table_file_outside_its_root_is_refused(root, path):
    relative, why = table_relative(root, path)
    assert relative is None and why


@pytest.mark.parametrize("fmt", sorted(OUTPUT_FORMATS))
@pytest.mark.parametrize("name", ["../victim", "a/../../victim", "/abs/victim"])
def test_every_output_format_refuses_a_shard_name_outside_the_output(tmp_path, fmt, name):
    out = OutputDir(str(tmp_path / "out"), {}, fmt)
    shard = Shard(url="x", path="x", name=name, fs=None, fingerprint={})
    for build in (
        lambda: out.output_path(shard),
        lambda: out.part_paths(shard),
        lambda: out.manifest_path(name),
        lambda: out.lock_path(name),
    ):
        with pytest.raises(InputDataError, match="refused"):
            build()


# ------------------------------------------------------------------------------ symbolic links


def _jsonl_job(tmp_path: Path, **output) -> dict:
    return {
        "name": "links",
        "input": {"path": str(tmp_path / "in"), "prompt_column": "prompt", "format": "jsonl"},
        "output": {"path": str(tmp_path / "out"), **output},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_link_inside_the_output_leading_out_of_it_is_exit_3(tmp_path, fmt):
    """``out/sub -> elsewhere`` and an input ``sub/data.jsonl``: the output's name is plain and
    relative, its place is not below the output; refused before anything is written there."""
    for name in ("a.jsonl", "sub/data.jsonl"):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text('{"prompt": "p"}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.parquet").write_bytes(b"not batchspec's")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sub").symlink_to(elsewhere)
    if fmt == "delta":  # the table's data folder, which delta-rs and batchspec write in
        (tmp_path / "out" / "sub").rename(tmp_path / "out" / "data")
    spec = build_spec(_jsonl_job(tmp_path, format=fmt))
    with pytest.raises(InputDataError, match="symbolic link below the output leads it outside") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and str(tmp_path / "out") in str(caught.value)
    assert _files_under(elsewhere) == {"data.parquet": b"not batchspec's"}


def test_a_linked_bookkeeping_folder_is_exit_3_and_nothing_lands_where_it_leads(tmp_path):
    """``out/_batchspec -> elsewhere``: no manifest, lease, temporary file or run summary there."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"prompt": "p"}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_batchspec").symlink_to(elsewhere)
    spec = build_spec(_jsonl_job(tmp_path))
    for _ in range(2):
        with pytest.raises(InputDataError, match="symbolic link below the output") as caught:
            run(spec)
        assert caught.value.exit_code == 3 and "_batchspec" in str(caught.value)
    assert _files_under(elsewhere) == {} and not list((tmp_path / "out").glob("*.parquet"))


# ------------------------------------------------------------------------------ Delta


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    """A Parquet file outside every table, with a prompt column, and its bytes."""
    path = tmp_path / "victim" / "data.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"prompt": ["keep me"], "k": pa.array([0], pa.int64())}), path)
    return path, path.read_bytes()


def _add_to_delta_log(table: str, path: str, size: int = 100) -> None:
    """One more commit in a local Delta table's log, adding ``path`` as a data file."""
    log = Path(table) / "_delta_log"
    version = max(int(p.stem) for p in log.glob("*.json")) + 1
    add = {
        "path": path,
        "size": size,
        "partitionValues": {},
        "modificationTime": int(time.time() * 1000),
        "dataChange": True,
        "stats": json.dumps({"numRecords": 1}),
    }
    (log / f"{version:020d}.json").write_text(json.dumps({"add": add}) + "\n")


def _files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "entry",
    [
        "../victim/data.parquet",
        "..%2Fvictim%2Fdata.parquet",
        "{tmp}/victim/data.parquet",
        "file://{tmp}/victim/data.parquet",
        "s3://other-bucket/victim/data.parquet",
        "data%00.parquet",
    ],
)
def test_a_delta_input_log_naming_a_file_outside_the_table_is_exit_3(tmp_path, entry):
    victim, before = _victim(tmp_path)
    make_input(tmp_path, "delta", files=1)
    _add_to_delta_log(str(tmp_path / "in"), entry.format(tmp=tmp_path), victim.stat().st_size)
    spec = build_spec(table_job(tmp_path, "delta", "parquet"))
    outside = _files_under(tmp_path / "victim")
    with pytest.raises(InputDataError) as caught:
        run(spec)
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert str(tmp_path / "in") in message and "outside the table" in message
    assert victim.read_bytes() == before and _files_under(tmp_path / "victim") == outside
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.parquet"))


def test_the_command_line_exits_3_naming_the_table_and_the_path(tmp_path):
    victim, before = _victim(tmp_path)
    make_input(tmp_path, "delta", files=1)
    _add_to_delta_log(str(tmp_path / "in"), "../victim/data.parquet", victim.stat().st_size)
    job = write_job(tmp_path / "job.yaml", table_job(tmp_path, "delta", "parquet"))
    for command in ("validate", "run"):
        done = run_table_cli(command, str(job), "--no-progress") if command == "run" else None
        done = done or run_table_cli(command, str(job))
        assert done.returncode == 3, (command, done.stdout, done.stderr)
        assert "../victim/data.parquet" in done.stderr and str(tmp_path / "in") in done.stderr
    assert victim.read_bytes() == before


def test_a_delta_output_log_naming_a_file_outside_the_table_is_exit_3(tmp_path):
    victim, before = _victim(tmp_path)
    make_input(tmp_path, "delta", files=2)
    spec = build_spec(table_job(tmp_path, "delta"))
    run(spec)
    # another writer's commit names a data file two levels above the output table
    _add_to_delta_log(str(tmp_path / "out"), "data/../../victim/data~abc.parquet")
    make_input(tmp_path, "delta", files=1, first=2)
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and str(tmp_path / "out") in str(caught.value)
    assert victim.read_bytes() == before and sorted(p.name for p in victim.parent.iterdir()) == [
        "data.parquet"
    ]


# ------------------------------------------------------------------------------ Iceberg


def _iceberg_add(catalog: dict, name: str, path: str) -> None:
    from pyiceberg.catalog import load_catalog

    load_catalog("default", **catalog).load_table(name).add_files([path])


@pytest.mark.parametrize("spelling", ["absolute", "dotdot"])
def test_an_iceberg_input_manifest_naming_a_file_outside_the_table_is_exit_3(tmp_path, spelling):
    victim, before = _victim(tmp_path)
    catalog = iceberg_catalog(tmp_path)
    make_input(tmp_path, "iceberg", files=1)
    from pyiceberg.catalog import load_catalog

    location = load_catalog("default", **catalog).load_table("ns.prompts").metadata.location.rstrip("/")
    depth = len(Path(location.removeprefix("file://")).relative_to(tmp_path).parts)
    path = f"file://{victim}" if spelling == "absolute" else f"{location}/{'../' * depth}victim/data.parquet"
    _iceberg_add(catalog, "ns.prompts", path)
    spec = build_spec(table_job(tmp_path, "iceberg", "parquet"))
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and "ns.prompts" in str(caught.value)
    assert victim.read_bytes() == before


def test_an_iceberg_output_manifest_naming_a_file_outside_the_table_is_exit_3(tmp_path):
    victim, before = _victim(tmp_path)
    make_input(tmp_path, "iceberg", files=2)
    raw = table_job(tmp_path, "iceberg")
    spec = build_spec(raw)
    run(spec)
    # another writer registers a file of the victim's shape, outside the output table, as ours
    (tmp_path / "victim" / "data~abc.parquet").write_bytes(pq_bytes := _result_like(spec))
    _iceberg_add(raw["output"]["catalog"], "ns.results", f"file://{tmp_path}/victim/data~abc.parquet")
    make_input(tmp_path, "iceberg", files=1, first=2)
    with pytest.raises(InputDataError, match="outside the table") as caught:
        run(spec)
    assert caught.value.exit_code == 3 and "ns.results" in str(caught.value)
    assert victim.read_bytes() == before
    assert (tmp_path / "victim" / "data~abc.parquet").read_bytes() == pq_bytes


def _result_like(spec) -> bytes:
    """A Parquet file with the output table's schema (one row read back from it), as bytes."""
    import io

    from batchspec.io.iceberg import load_catalog

    table = load_catalog(spec.output.catalog, "output.catalog").load_table(spec.output.table)
    rows = table.scan(limit=1).to_arrow()
    sink = io.BytesIO()
    pq.write_table(rows, sink)
    return sink.getvalue()
