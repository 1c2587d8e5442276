"""How `make test` splits the suite (tools/run_tests.py), read by tests/conftest.py too.

The engine tests whose engines live in processes of their own (`batchspec` subprocesses of the
distill, kill, tune and auto tests, Ray replicas, Airflow's tasks), by file or, where the rest of
a file runs on the shared engines, by test function (a node id, every parameter of it): marked
``own_processes``, they leave the group of the shared in-process engines, which runs in one
pytest process, and run in pytest processes of their own beside it (tools/run_tests.py). A whole
file where it can be, so that its module-scoped runs happen once.

Listed longest first, the order `make test` starts them in (a pytest process each). After each,
its wall time in one fresh clone's `CI=true bash .ci/run` (2 cores, two other pytest processes
beside it; docs/development.md has the run).
"""

from __future__ import annotations

OWN_PROCESS_FILES = (
    "tests/run/test_ray.py",  # 986 s (2.0 CPU-minutes counted: it mostly waits)
    "tests/run/test_recovery.py",  # 528
    "tests/run/test_supervision.py",  # 300
    "tests/engine/test_pooling.py::test_a_pooling_job_killed_and_rerun_holds_every_row_once",  # 207
    "tests/examples/test_airflow.py",  # 159
    "tests/distill/test_distill.py",  # 125
    "tests/distill/test_pard.py",  # 368 (parallel drafts and heads; a warm run, beside two others)
    "tests/tune/test_tune.py",  # 114
    "tests/cli/test_tables_e2e.py",  # 112
    "tests/tune/test_auto.py",  # 103
    "tests/examples/test_examples.py",  # 92
    "tests/distill/test_distill_head.py",  # 65
    "tests/engine/test_images_processes.py",  # 125 (an image job killed and rerun on Ray, tune, auto)
    "tests/engine/test_lifeline.py",  # 45
    "tests/tune/test_heads_tune.py",  # 43
    "tests/tune/test_knobs.py",  # 39
)

#: Of those, the ones that mostly wait on processes they start (Ray's daemons, workers and
#: replicas, each importing vLLM): `make test` runs every other pytest process at a lower CPU
#: priority (tools/run_tests.py), so that on a loaded machine these get the CPU the moment they
#: need it, instead of queueing behind the CPU-bound ones and ending last.
LATENCY_BOUND = frozenset({"tests/run/test_ray.py"})

#: Every model `make models` builds (the Makefile's ``models`` target), by the file written
#: last in its folder under ``.models``: a model is built when that file is there.
MODEL_MARKERS = {
    "target": ".batchspec-complete",
    "draft": ".batchspec-complete",
    "draft-large": ".batchspec-complete",
    "target-large": ".batchspec-complete",
    "lora-upper": ".batchspec-complete",
    "lora-comment": ".batchspec-complete",
    "head": "batchspec-model.json",
    "head-large": "batchspec-model.json",
    "classifier": ".batchspec-complete",
    "cross-encoder": ".batchspec-complete",
    "vlm": ".batchspec-complete",
    "vlm-draft": ".batchspec-complete",
    "reasoner": ".batchspec-complete",
    "reasoner-draft": ".batchspec-complete",
}

#: What the models are built from, and so built first (about 6 minutes on an empty model cache,
#: on both cores): `make test` starts the tests that need no model once these are built, not
#: before, so that they do not slow it down (tools/run_tests.py).
FIRST_MODELS = ("target", "draft")

#: Built last (about 12 minutes on one core after the first): `make test` starts the tests that
#: need models once every other one is built, and a test that needs these is marked ``reasoner``:
#: it runs last in its pytest process and waits there until they are built (tests/conftest.py).
LATE_MODELS = ("reasoner", "reasoner-draft")
