"""How `make test` splits the suite (tools/run_tests.py), read by tests/conftest.py too.

The engine tests whose engines live in processes of their own (`batchspec` subprocesses of the
distill, kill, tune and auto tests, Ray replicas, Airflow's tasks), by file: marked
``own_processes``, they leave the lane of the shared in-process engines and run in a pytest
process of their own beside it (tools/run_tests.py). A whole file, so that its module-scoped runs
happen once.

Listed longest first, the order `make test` starts them in (a pytest process a file). After
each, its wall time in one fresh clone's CI run (2 cores, the other lanes beside it).
"""

from __future__ import annotations

OWN_PROCESS_FILES = (
    "tests/run/test_recovery.py",  # 1,039 s
    "tests/tune/test_tune.py",  # 453
    "tests/run/test_ray.py",  # 443
    "tests/run/test_supervision.py",  # 271
    "tests/examples/test_airflow.py",  # 172
    "tests/tune/test_auto.py",  # 117
    "tests/examples/test_examples.py",  # 114
    "tests/distill/test_distill.py",  # 90
    "tests/distill/test_distill_head.py",  # 65
    "tests/tune/test_heads_tune.py",  # 50
    "tests/tune/test_knobs.py",  # 43
)
