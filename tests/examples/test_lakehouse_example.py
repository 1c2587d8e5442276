"""examples/lakehouse/ on the real engine (the session's shared engine): a Delta table of
prompts made by its script, the job appending to a Delta table of results, and its polars query
of what a downstream reader sees; a second run after the prompts table grew does only the new
files."""

from __future__ import annotations

import subprocess
import sys

import polars as pl
import pytest
from helpers.jobs import MODELS, ROOT

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

EXAMPLE = ROOT / "examples" / "lakehouse"


def test_lakehouse_example_appends_every_english_prompt_once(tmp_path, shared_engines):
    prompts, results = tmp_path / "prompts", tmp_path / "results"
    subprocess.run([sys.executable, EXAMPLE / "make_prompts.py", prompts, "2"], check=True)
    env = {"PROMPTS_TABLE": str(prompts), "RESULTS_TABLE": str(results)}
    spec = load_spec(EXAMPLE / "job.yaml", [f"model.target={MODELS / 'target'}"], environ=env)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    english = pl.read_delta(str(prompts)).filter(pl.col("lang") == "en")["id"].sort().to_list()
    assert pl.read_delta(str(results))["request_id"].sort().to_list() == english
    query = subprocess.run(
        [sys.executable, EXAMPLE / "query.py", results, prompts], capture_output=True, text=True, check=True
    )
    assert "answered" in query.stdout and "en" in query.stdout, query.stdout
    # the prompts table grows: the next run does only its new file
    from importlib.machinery import SourceFileLoader

    SourceFileLoader("make_prompts", str(EXAMPLE / "make_prompts.py")).load_module().append(str(prompts), 2)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    english = pl.read_delta(str(prompts)).filter(pl.col("lang") == "en")["id"].sort().to_list()
    assert len(english) == 12
    assert pl.read_delta(str(results))["request_id"].sort().to_list() == english
