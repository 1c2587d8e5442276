"""Shard discovery over fsspec, output naming, worker assignment, committed state."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.jobs import write_parquet

from batchspec.errors import InputDataError, SpecError
from batchspec.io.listing import assign, discover_shards, worker_of
from batchspec.io.output_dir import OutputDir


def _shard(path):
    return write_parquet(path, {"prompt": ["a"]})


def _output_files(tmp_path, shards) -> list[str]:
    """Each shard's output file as a run writes it, relative to the output directory."""
    out = OutputDir(str(tmp_path / "out"), {})
    return [out.output_path(s)[len(out.path) + 1 :] for s in shards]


def test_glob_lists_sorted_shards_named_after_files(tmp_path):
    for name in ("b", "a", "c"):
        _shard(tmp_path / f"{name}.parquet")
    (tmp_path / "notes.txt").write_text("x")
    shards = discover_shards([str(tmp_path / "*.parquet")], {})
    assert [s.name for s in shards] == ["a", "b", "c"]
    assert _output_files(tmp_path, shards) == ["a.parquet", "b.parquet", "c.parquet"]
    # the fingerprint's size is the file's own size, so a rewritten input is noticed
    assert [s.fingerprint["size"] for s in shards] == [
        (tmp_path / f"{name}.parquet").stat().st_size for name in ("a", "b", "c")
    ]


def test_directory_and_nested_glob_keep_subdirectories_in_names(tmp_path):
    _shard(tmp_path / "day=1" / "part-0.parquet")
    _shard(tmp_path / "day=2" / "part-0.parquet")
    for paths in ([str(tmp_path)], [str(tmp_path / "*" / "*.parquet")]):
        names = [s.name for s in discover_shards(paths, {})]
        assert names == ["day=1/part-0", "day=2/part-0"]
        assert _output_files(tmp_path, discover_shards(paths, {})) == [
            "day=1/part-0.parquet",
            "day=2/part-0.parquet",
        ]


def test_output_names_depend_only_on_a_files_own_path(tmp_path):
    """`a/x.parquet` and `a__x.parquet` once renamed each other (both got a hash suffix, which
    vanished when one was removed): a name is now the file's own relative path."""
    _shard(tmp_path / "a" / "x.parquet")
    _shard(tmp_path / "a__x.parquet")
    pattern = [str(tmp_path / "**" / "*.parquet")]
    assert [s.name for s in discover_shards([str(tmp_path)], {})] == ["a/x", "a__x"]
    (tmp_path / "a__x.parquet").unlink()
    assert [s.name for s in discover_shards([str(tmp_path)], {})] == ["a/x"]
    assert "a/x" in [s.name for s in discover_shards(pattern, {})]


def test_same_file_name_from_two_roots_is_a_spec_error(tmp_path):
    _shard(tmp_path / "x" / "part-0.parquet")
    _shard(tmp_path / "y" / "part-0.parquet")
    with pytest.raises(SpecError) as err:
        discover_shards([str(tmp_path / "x" / "*.parquet"), str(tmp_path / "y" / "*.parquet")], {})
    assert err.value.key == "input.path"
    assert "x/part-0.parquet" in str(err.value) and "y/part-0.parquet" in str(err.value)
    # one pattern whose base keeps the directories apart works
    names = [s.name for s in discover_shards([str(tmp_path / "*" / "*.parquet")], {})]
    assert names == ["x/part-0", "y/part-0"]
    # and the same file listed twice is one shard
    assert len(discover_shards([str(tmp_path / "x" / "part-0.parquet")] * 2, {})) == 1


def test_memory_filesystem(tmp_path):
    fs = fsspec.filesystem("memory")
    for i in range(2):
        with fs.open(f"/bucket/in/p{i}.parquet", "wb") as f:
            pq.write_table(pa.table({"prompt": [f"x{i}"]}), f)
    shards = discover_shards(["memory://bucket/in/*.parquet"], {})
    assert [s.name for s in shards] == ["p0", "p1"]
    assert [s.url for s in shards] == ["memory:///bucket/in/p0.parquet", "memory:///bucket/in/p1.parquet"]
    # the URL is what the summary, the manifest and error messages name: it must open the file
    with fsspec.open(shards[1].url, "rb") as f:
        assert pq.read_table(f)["prompt"].to_pylist() == ["x1"]


def test_no_match_is_bad_input(tmp_path):
    with pytest.raises(InputDataError, match="no input shards matched"):
        discover_shards([str(tmp_path / "*.parquet")], {})
    with pytest.raises(InputDataError, match="no such input"):
        discover_shards([str(tmp_path / "missing.parquet")], {})


def test_worker_assignment_is_stable_and_complete():
    names = [f"part-{i:05d}" for i in range(200)]
    for n in (1, 3, 8):
        owners = {name: worker_of(name, n) for name in names}
        assert set(owners.values()) <= set(range(n))
        # the same shard goes to the same worker whatever the order or the other shards
        assert {name: worker_of(name, n) for name in reversed(names[:50])} == {
            name: owners[name] for name in names[:50]
        }
    counts = [sum(worker_of(name, 4) == w for name in names) for w in range(4)]
    assert min(counts) > 25  # spread over the workers


def test_assign_partitions_shards(tmp_path):
    for i in range(10):
        _shard(tmp_path / f"p{i}.parquet")
    shards = discover_shards([str(tmp_path / "*.parquet")], {})
    parts = [assign(shards, w, 3) for w in range(3)]
    assert sorted(s.name for p in parts for s in p) == sorted(s.name for s in shards)
    with pytest.raises(SpecError):
        assign(shards, 3, 3)


def test_shard_state(tmp_path):
    src = _shard(tmp_path / "in" / "a.parquet")
    shard = discover_shards([str(src)], {})[0]
    out = OutputDir(str(tmp_path / "out"), {})
    assert out.shard_state(shard) == "pending"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.parquet").write_bytes(b"x")
    assert out.shard_state(shard) == "partial"  # file without a record
    out.write_json(out.manifest_path("a"), {"input_fingerprint": shard.fingerprint, "rows": 1})
    assert out.shard_state(shard) == "committed"
    out.write_json(out.manifest_path("a"), {"input_fingerprint": {"size": 1}, "rows": 1})
    assert out.shard_state(shard) == "partial"  # the input changed since
    (tmp_path / "out" / "a.parquet").unlink()
    assert out.shard_state(shard) == "partial"  # record without a file


def test_listing_skips_the_output_however_its_store_is_spelled(tmp_path, s3_server):
    """`same_store` judges stores as the overlap check does, so a run's listing (which passes
    the output's path when the stores agree) and tune's sample (which passes output.path as
    written) both skip the output's files under an input directory, whatever the spelling of
    the endpoint."""
    import s3fs

    from batchspec.io.locations import same_store

    endpoint, options = s3_server
    creds = {"key": options["key"], "secret": options["secret"]}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir("listing-skip")
    data = _shard(tmp_path / "p0.parquet").read_bytes()
    for key in ("d/p0.parquet", "d/out/p0.parquet", "d/outside/p1.parquet"):
        fs.pipe_file(f"listing-skip/{key}", data)
    in_opts = {**creds, "endpoint_url": f"{endpoint}/"}
    out = OutputDir("s3a://listing-skip//d/out/", {**creds, "client_kwargs": {"endpoint_url": endpoint}})
    assert same_store(["s3://listing-skip/d"], in_opts, out)
    for exclude in (out.path, "s3a://listing-skip//d/out/"):
        names = [s.name for s in discover_shards(["s3://listing-skip/d"], in_opts, exclude=exclude)]
        assert names == ["outside/p1", "p0"], exclude
    # another server's output path says nothing about this one's files
    elsewhere = OutputDir(
        "s3://listing-skip/d/out", {**creds, "endpoint_url": endpoint.rsplit(":", 1)[0] + ":1"}
    )
    assert not same_store(["s3://listing-skip/d"], in_opts, elsewhere)
    # a local output path never hides a bucket's keys
    assert len(discover_shards(["s3://listing-skip/d"], in_opts, exclude="/listing-skip/d/out")) == 3
