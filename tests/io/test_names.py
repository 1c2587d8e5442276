"""Names batchspec builds from a shard's name (batchspec/io/contained.py, output_dir.py): a
temporary file's name never grows with the shard's, so a shard whose output name fits the file
system is written; one whose output name itself cannot exist is a bad shard, exit 3 naming it
before any model loads (or left out with ``on_bad_shard: skip``), never an exit 1 that stops
every shard on every rerun. On the fake engine, through the command line and run_job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.fake_runs import run
from helpers.jobs import MODELS, write_parquet
from helpers.tables import run_table_cli, write_job

from batchspec.errors import InputDataError
from batchspec.run.status import job_status
from batchspec.spec.build import build_spec

#: every run checks its spec against vLLM's classes, on the fake engine too
pytestmark = pytest.mark.vllm

#: What each input format's line holds.
LINES = {
    "jsonl": {"prompt": "p"},
    "openai": {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "unused", "prompt": "p"},
    },
}


def _raw(
    tmp_path: Path, output_format: str = "parquet", input_format: str | None = None, **input_extra
) -> dict:
    inputs = {"path": str(tmp_path / "in"), **input_extra}
    if input_format is not None:
        inputs["format"] = input_format
    if input_format != "openai":
        inputs["prompt_column"] = "prompt"
    return {
        "name": "names",
        "input": inputs,
        "output": {"path": str(tmp_path / "out"), "format": output_format},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


def _write(tmp_path: Path, name: str, input_format: str | None = None) -> None:
    """One input file ``in/<name>``: two prompts in Parquet, or a line of ``input_format``."""
    path = tmp_path / "in" / name
    if input_format is None:
        write_parquet(path, {"prompt": ["p0", "p1"]})
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(LINES[input_format]) + "\n")


def _states(raw: dict) -> dict[str, str]:
    return {s["shard"]: s["state"] for s in job_status(build_spec(raw))["shards"]}


def test_a_nested_shard_whose_output_name_fits_is_written_with_the_others(tmp_path):
    """A shard at a nested path (242 bytes in all): its temporary file, named after the whole
    path flattened into one name, was over the 255 bytes a name may have: exit 1, no shard."""
    long = "d/" + "x" * 232 + ".parquet"
    for name in ("a.parquet", long, "z.parquet"):
        _write(tmp_path, name)
    raw = _raw(tmp_path)
    job = write_job(tmp_path / "job.yaml", raw)
    done = run_table_cli("run", str(job), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / long).is_file()
    assert _states(raw) == dict.fromkeys(["a", long.removesuffix(".parquet"), "z"], "committed")
    rerun = run_table_cli("run", str(job), "--no-progress")
    assert rerun.returncode == 0 and "0 shards committed" in rerun.stderr, rerun.stderr


@pytest.mark.parametrize(
    ("output_format", "input_format", "name"),
    [
        ("parquet", "jsonl", "x" * 249 + ".jsonl"),  # -> x...x.parquet: 257 bytes
        ("openai", "openai", "x" * 249 + ".jsonl"),  # -> x...x.output.jsonl: 262 bytes
        ("delta", None, "x" * 240 + ".parquet"),  # -> data/x...x~<token>.parquet: 261 bytes
    ],
)
def test_a_shard_whose_output_name_cannot_exist_is_exit_3_naming_it(
    tmp_path, output_format, input_format, name
):
    """A bad shard, found before any shard runs: the run names it, nothing is written; a rerun
    (the output folder there now) says the same."""
    for file in ("a.jsonl" if input_format else "a.parquet", name):
        _write(tmp_path, file, input_format)
    spec = build_spec(_raw(tmp_path, output_format, input_format))
    for _ in range(2):
        with pytest.raises(InputDataError, match="longer than the 255 bytes a file name may have") as caught:
            run(spec)
        assert caught.value.exit_code == 3 and "x" * 240 in str(caught.value)
        out = tmp_path / "out"
        assert not [p for p in out.rglob("*") if p.is_file() and "_batchspec" not in p.parts]


def test_with_on_bad_shard_skip_the_others_are_committed(tmp_path):
    long = "x" * 247 + ".parquet"  # its output (x...x.parquet) and manifest (x...x.json) fit
    for name in ("a.parquet", long, "z.parquet"):
        _write(tmp_path, name)
    _write(tmp_path, "y" * 249 + ".jsonl", "jsonl")  # -> y...y.parquet: 257 bytes
    raw = _raw(tmp_path, on_bad_shard="skip")
    _, events = run(build_spec(raw))  # no exception: exit 0
    assert [f["shard"] for e, f in events if e == "shard_failed"] == ["y" * 249]
    states = _states(raw)
    assert states.pop("y" * 249) == "pending"
    assert states == dict.fromkeys(["a", "x" * 247, "z"], "committed")


def test_validate_names_a_shard_whose_output_name_cannot_exist(models, tmp_path):
    from batchspec.run.validate import validate_job

    for name in ("a.jsonl", "x" * 249 + ".jsonl"):
        _write(tmp_path, name, "jsonl")
    raw = _raw(tmp_path, input_format="jsonl")
    raw["model"]["target"] = str(MODELS / "target")  # validate tokenizes with the target's tokenizer
    report = validate_job(build_spec(raw))
    assert report.exit_code == 3
    problems = {check.name: check.problem for check in report.shards}
    assert problems["a"] is None and "longer than the 255 bytes" in problems["x" * 249]
