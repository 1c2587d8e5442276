"""``tools/gpu_check.py`` on the CPU, with tiny sizes: distill's draft and head trainers run
without vLLM and the script prints one JSON line with each one's device, wall time, held-out
figure before and after, and peak GPU memory (null here). On a GPU machine the same script,
with its default sizes, gives the figures for BENCHMARKS.md (docs/development.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.jobs import ROOT

pytestmark = pytest.mark.vllm


def test_gpu_check_runs_both_trainers_on_the_cpu_and_prints_one_json_line(models):
    tiny = ["--sequences", "24", "--heldout", "8", "--prompt-tokens", "24", "--new-tokens", "16"]
    steps = ["--draft-steps", "10", "--head-steps", "12", "--batch-size", "4"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", *tiny, *steps],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    assert report["device"] == "cpu" and report["gpu"] is None and report["sequences"] == 24
    for name, steps_run in (("draft", 10), ("head", 12)):
        part = report[name]
        assert part["device"] == "cpu" and part["peak_gpu_mib"] is None, part
        assert part["wall_s"] > 0 and part["steps"] == steps_run, part
        assert 0 <= part["heldout_before"] <= part["heldout_after"], part
    assert report["draft"]["heldout_after"] <= 1 and report["head"]["heldout_after"] <= 3
    # a new head starts from nothing: a few steps already get tokens right
    assert report["head"]["heldout_after"] > report["head"]["heldout_before"]
    assert report["head"]["features_s"] <= report["head"]["wall_s"]


@pytest.mark.parametrize("shape", ["2048,16", "2048,0,8192", "100,2,3", "a,b,c"])
def test_a_malformed_random_target_is_refused_naming_the_option(shape):
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--random-target", shape],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "--random-target" in done.stderr and repr(shape) in done.stderr


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--batch-size", "0"),
        ("--new-tokens", "0"),
        ("--prompt-tokens", "-3"),
        ("--sequences", "0"),
        ("--heldout", "0"),
        ("--draft-steps", "-1"),
        ("--head-steps", "0"),
        ("--patience", "x"),
    ],
)
def test_a_count_that_is_not_positive_is_refused_naming_the_option_before_any_work(flag, value):
    """``--batch-size 0`` was a traceback after a minute of generating continuations."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), flag, value],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert f"argument {flag}: expected a positive integer, got {value!r}" in done.stderr, done.stderr
