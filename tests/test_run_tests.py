"""`make test`'s schedule on an empty model cache (tools/run_tests.py, tests/helpers/lanes.py): what
starts while the models are built, and a test that waits for a model built last."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import time

import conftest
import pytest
import run_tests
from helpers.jobs import ROOT
from helpers.lanes import FIRST_MODELS, LATE_MODELS, MODEL_MARKERS


def test_the_models_listed_are_the_ones_make_models_builds():
    """Each model the ``models`` target names is listed with its marker, and each one listed is
    an output of a build the Makefile caches."""
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^DEMO_MODELS :=(.*)$", makefile, re.M).group(1)
    rule = re.search(r"^models:(.*?[^\\])$", makefile, re.S | re.M).group(1)
    named = set(re.findall(r"\$\(MODELS\)/([\w-]+)/([\w.-]+)", demo + rule))
    groups = re.findall(r"\$\(call CACHED,([\w$* -]+)", makefile)
    outputs = [o.replace("$*", "*") for group in groups for o in group.split()]  # lora-$*: a pattern rule's
    assert named <= set(MODEL_MARKERS.items())
    assert all(any(fnmatch.fnmatch(name, o) for o in outputs) for name in MODEL_MARKERS), outputs
    assert len(named) >= 10 and set(FIRST_MODELS) | set(LATE_MODELS) <= set(MODEL_MARKERS)


def _unit(name: str, needs_models: bool, status: int | None = None) -> run_tests.Unit:
    unit = run_tests.Unit(name, ["true"], name, needs_models)
    unit.status = status
    return unit


def _mark(models, names):
    for name in names:
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / MODEL_MARKERS[name]).write_text("")


def test_while_the_models_are_built_each_unit_starts_when_what_it_waits_for_is(tmp_path, monkeypatch):
    monkeypatch.setattr(run_tests, "MODELS_DIR", tmp_path)
    models = _unit(run_tests.MODELS, needs_models=False)
    no_model, needs = _unit("rest", needs_models=False), _unit("engines", needs_models=True)
    # a marker of an earlier run is not this run's: `make models` may be about to build it again
    _mark(tmp_path, MODEL_MARKERS)
    time.sleep(1.1)
    since = time.time()
    assert run_tests._can_start(models, models, since)
    assert not run_tests._can_start(no_model, models, since)
    assert not run_tests._can_start(needs, models, since)

    for name in MODEL_MARKERS:  # `make models` builds them again
        (tmp_path / name / MODEL_MARKERS[name]).unlink()
    _mark(tmp_path, FIRST_MODELS)
    assert run_tests._can_start(no_model, models, since)
    assert not run_tests._can_start(needs, models, since)

    _mark(tmp_path, [name for name in MODEL_MARKERS if name not in LATE_MODELS])
    assert run_tests._can_start(needs, models, since)

    models.status = 2  # failed: what needs none still runs
    for name in MODEL_MARKERS:
        (tmp_path / name / MODEL_MARKERS[name]).unlink(missing_ok=True)
    assert run_tests._can_start(no_model, models, since)
    assert not run_tests._can_start(needs, models, since)
    models.status = 0
    assert run_tests._can_start(needs, models, since)


def test_a_test_waits_for_a_late_model_while_it_is_built_and_fails_once_nothing_builds_it(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(conftest, "MODELS", tmp_path)
    name = LATE_MODELS[0]
    marker = tmp_path / name / MODEL_MARKERS[name]
    builder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import pathlib, time; time.sleep(1.5); p = pathlib.Path({str(marker)!r}); "
            "p.parent.mkdir(parents=True); p.write_text('')",
        ]
    )
    monkeypatch.setenv("BATCHSPEC_TEST_MODELS_PID", str(builder.pid))
    try:
        conftest._wait_for_models((name,))  # returns once it is there
        assert marker.exists()
    finally:
        builder.wait()
    # the builder gone and the model not there: a failure naming it, not a wait
    with pytest.raises(pytest.fail.Exception, match=LATE_MODELS[1]):
        conftest._wait_for_models((LATE_MODELS[1],))
    monkeypatch.delenv("BATCHSPEC_TEST_MODELS_PID")
    with pytest.raises(pytest.fail.Exception, match="make models"):
        conftest._wait_for_models((LATE_MODELS[1],))


def test_tests_that_need_the_late_models_run_last_in_their_process():
    """The engine group's order: every test marked ``reasoner`` after every other."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "engine_group and not own_processes",
            "tests/cli",
            "tests/examples",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "BATCHSPEC_TEST_ENGINE_LOG": ""},
    ).stdout.splitlines()
    ids = [line for line in out if "::" in line]
    late = [i for i, line in enumerate(ids) if "reasoning_e2e" in line or "classify_example" in line]
    assert late and ids, out
    assert late == list(range(len(ids) - len(late), len(ids))), ids
