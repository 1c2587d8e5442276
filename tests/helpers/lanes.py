"""How `make test` splits the suite (tools/run_tests.py), read by tests/conftest.py too.

The engine tests whose engines live in processes of their own (`batchspec` subprocesses of the
distill, kill, tune and auto tests, Ray replicas, Airflow's tasks), by file or, where the rest of
a file runs on the shared engines, by test function (a node id, every parameter of it): marked
``own_processes``, they leave the group of the shared in-process engines, which runs in one
pytest process, and run in pytest processes of their own beside it (tools/run_tests.py). A whole
file where it can be, so that its module-scoped runs happen once.

Listed longest first, the order `make test` starts them in (a pytest process each). After each,
its wall time in one fresh clone's CI run (2 cores, two other pytest processes beside it).
"""

from __future__ import annotations

OWN_PROCESS_FILES = (
    "tests/run/test_recovery.py",  # 593 s
    "tests/run/test_ray.py",  # 501
    "tests/run/test_supervision.py",  # 377
    "tests/engine/test_pooling.py::test_a_pooling_job_killed_and_rerun_holds_every_row_once",  # ~350
    "tests/examples/test_airflow.py",  # 276
    "tests/tune/test_tune.py",  # 235
    "tests/examples/test_examples.py",  # 178
    "tests/distill/test_distill.py",  # 177
    "tests/cli/test_tables_e2e.py",  # ~175
    "tests/tune/test_auto.py",  # 171
    "tests/distill/test_distill_head.py",  # 100
    "tests/tune/test_heads_tune.py",  # 78
    "tests/engine/test_lifeline.py",  # ~65
    "tests/tune/test_knobs.py",  # 67
)
