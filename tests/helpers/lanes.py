"""How `make test` splits the suite (tools/run_tests.py), read by tests/conftest.py too.

The engine tests whose engines live in processes of their own (`batchspec` subprocesses of the
distill, kill, tune and auto tests, Ray replicas, Airflow's tasks), by file: marked
``own_processes``, they leave the lane of the shared in-process engines and run in a pytest
process of their own beside it (tools/run_tests.py). A whole file, so that its module-scoped runs
happen once.

Listed longest first, the order that lane runs them in. After each, the CPU seconds it cost in
one run (the conftest's CPU summary, 2 cores, the other lanes beside it), and for Ray's file,
whose replicas are no children the summary sees, its wall time.
"""

from __future__ import annotations

OWN_PROCESS_FILES = (
    "tests/run/test_recovery.py",  # 491
    "tests/run/test_ray.py",  # ~400 s wall
    "tests/tune/test_tune.py",  # 259
    "tests/examples/test_airflow.py",  # 209 (its Airflow processes: 390 s wall)
    "tests/run/test_supervision.py",  # 168
    "tests/distill/test_distill_head.py",  # 167
    "tests/distill/test_distill.py",  # 165
    "tests/tune/test_auto.py",  # 136
    "tests/examples/test_examples.py",  # 114
    "tests/tune/test_heads_tune.py",  # 66
    "tests/tune/test_knobs.py",  # 46
)
