"""examples/images/ run for real: make_pictures.py writes the photos and the rows naming them,
then the job runs on the session's shared engines; each row's answer is its photo's, and the
corrupt photo's row is an error row while the rest run."""

from __future__ import annotations

import importlib.util

import pytest
from helpers.jobs import MODELS, ROOT, read_output

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

EXAMPLE = ROOT / "examples" / "images"


def test_images_example_answers_from_each_rows_photo(tmp_path, shared_engines):
    loader = importlib.util.spec_from_file_location("make_pictures", EXAMPLE / "make_pictures.py")
    make_pictures = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(make_pictures)
    rows_path = make_pictures.main(tmp_path / "pictures")
    env = {
        "BATCHSPEC_EXAMPLE_INPUT": str(rows_path),
        "BATCHSPEC_EXAMPLE_IMAGES": str(tmp_path / "pictures" / "photos"),
        "BATCHSPEC_EXAMPLE_OUTPUT": str(tmp_path / "out"),
    }
    spec = load_spec(EXAMPLE / "job.yaml", [f"model.target={MODELS / 'vlm'}"], environ=env)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    rows = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: int(r["id"].split("-")[1]))
    *good, broken = rows
    assert broken["error"].startswith("bad image: corrupt") and broken["finish_reason"] == "error"
    assert all(r["error"] is None for r in good), good
    right = sum(r["generated_text"].strip() == r["truth"] for r in good)
    assert right >= len(good) - 2, [(r["generated_text"], r["truth"]) for r in good]
    assert all(r["spec_num_draft_tokens"] is not None for r in good)  # n-gram ran
