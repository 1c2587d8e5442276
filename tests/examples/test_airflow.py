"""examples/airflow run by Airflow itself: Airflow 3 from its own venv (`make airflow`) with a
sqlite metadata database in tmp_path imports the DAG file, then `airflow dags test` runs it with 2
mapped workers on the tiny model pair over a dated partition on a local S3 server; every input row
must be in the output exactly once and the status task must pass, and batchspec must have seen only
the allow-listed part of the worker's environment. A bad spec (exit 2) must fail the mapped tasks
on their first try, with no retry.

`airflow dags test` runs one task at a time, so the two mapped workers never hold two engines at
once. The DAG runs batchspec as a command: Airflow and vLLM never share a venv."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers.jobs import (
    DRAFT,
    ENGINE,
    INLINE_ENGINE,
    MODELS,
    ROOT,
    S3_KEY,
    S3_SECRET,
    write_job,
    write_parquet,
)

pytestmark = pytest.mark.engine
AIRFLOW = ROOT / ".airflow-venv" / "bin" / "airflow"
EXAMPLE = ROOT / "examples" / "airflow"
DAG_ID = "batchspec_nightly"
BATCHSPEC = str(Path(sys.executable).with_name("batchspec"))
#: What batchspec may see of an Airflow worker's environment (the DAG's docstring): the basics,
#: the spec's ${VAR}s (DS from the DAG, BATCHSPEC_*, S3_ENDPOINT_URL), batchspec's, vLLM's, the
#: Hub's and the GPU's variables, and AWS_* because the job is on S3.
ALLOWED_ENV = re.compile(
    r"(PATH|HOME|USER|LOGNAME|LANG|LANGUAGE|LC_\w+|TZ|TMPDIR|XDG_CACHE_HOME|LD_LIBRARY_PATH|"
    r"OMP_NUM_THREADS|(HTTPS?|NO)_PROXY|(https?|no)_proxy|SSL_CERT_(FILE|DIR)|REQUESTS_CA_BUNDLE|"
    r"CURL_CA_BUNDLE|DS|S3_ENDPOINT_URL|(BATCHSPEC|VLLM|HF|CUDA|NVIDIA|NCCL|AWS)_\w+)"
)
#: In the worker's environment, never batchspec's: Airflow's own, a connection's password, a
#: secret of something else, another cloud's settings (the job is on S3 only).
NOT_FOR_BATCHSPEC = {
    "AIRFLOW_CONN_WAREHOUSE": "postgres://etl:warehouse-pw@db:5432/prod",
    "WAREHOUSE_PASSWORD": "not-for-batchspec",
    "GOOGLE_CLOUD_PROJECT": "not-this-job",
    "AZURE_STORAGE_CONNECTION_STRING": "AccountKey=not-this-job",
}


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    """An Airflow home with a migrated sqlite database and the example's DAG folder (a copy, so
    Airflow writes nothing into the repo); yields a function running the airflow CLI there."""
    if not AIRFLOW.exists():
        reason = f"{AIRFLOW.relative_to(ROOT)} is missing: run `make airflow` (make test does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    home = tmp_path_factory.mktemp("airflow")
    dags = home / "dags"
    shutil.copytree(EXAMPLE, dags, ignore=shutil.ignore_patterns("__pycache__"))
    base = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        # where an unexpected exit 1 is retried, retry at once and only once: no long waits
        "BATCHSPEC_RETRIES": "1",
        "BATCHSPEC_RETRY_DELAY_S": "1",
    }

    def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(AIRFLOW), *args],
            env={**base, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=home,
        )

    for step in (["db", "migrate"], ["dags", "reserialize"]):
        done = cli(*step)
        assert done.returncode == 0, f"airflow {' '.join(step)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    errors = cli("dags", "list-import-errors", "-o", "json")
    assert errors.returncode == 0 and _json(errors.stdout) == [], errors.stdout + errors.stderr
    listed = _json(cli("dags", "list", "-o", "json").stdout)
    assert DAG_ID in [d["dag_id"] for d in listed], listed
    cli.home = home
    return cli


def _json(stdout: str) -> list[dict]:
    """The JSON list an airflow command printed (its warnings go to stdout too)."""
    lines = [line for line in stdout.splitlines() if line.startswith("[")]
    assert lines, f"no JSON in: {stdout[-2000:]}"
    return json.loads(lines[-1])


def _task_instances(airflow, logical_date: str) -> dict[tuple[str, int], tuple[str, int]]:
    """(task_id, map_index) -> (state, try_number) for the DAG run of ``logical_date``, from the
    CLI's run list and the metadata database (the CLI does not show try numbers)."""
    runs = _json(airflow("dags", "list-runs", DAG_ID, "-o", "json").stdout)
    run_id = next(r["run_id"] for r in runs if r["logical_date"].startswith(logical_date))
    with sqlite3.connect(airflow.home / "airflow.db") as db:
        rows = db.execute(
            "SELECT task_id, map_index, state, try_number FROM task_instance WHERE dag_id = ? AND run_id = ?",
            (DAG_ID, run_id),
        ).fetchall()
    return {(task, index): (state, tries) for task, index, state, tries in rows}


def _env_recorder(directory: Path) -> Path:
    """A batchspec command for the DAG that writes the names (not the values) of the environment
    it was started with to DIRECTORY/<subcommand>-<pid>.txt, then runs batchspec itself."""
    directory.mkdir()
    script = directory / "batchspec"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"with open(f'{directory}/{{sys.argv[1]}}-{{os.getpid()}}.txt', 'w') as f:\n"
        "    f.write('\\n'.join(os.environ))\n"
        f"os.execv({BATCHSPEC!r}, [{BATCHSPEC!r}, *sys.argv[1:]])\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_nightly_dag_maps_two_workers_and_covers_every_row_once(airflow, models, s3_server, tmp_path):
    import s3fs
    from demo_data import prompt_table

    endpoint, options = s3_server
    ds, bucket = "2026-11-20", "airflow-nightly"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    expected = []
    for i in range(4):
        table = prompt_table(5, seed=1400 + i, first_id=5 * i)
        buf = io.BytesIO()
        pq.write_table(table, buf)
        fs.pipe(f"{bucket}/prompts/{ds}/part-{i}.parquet", buf.getvalue())
        expected += table["id"].to_pylist()
    # another day's partition: a DAG that ignored {{ ds }} would read it too
    fs.pipe(f"{bucket}/prompts/2026-11-19/part-0.parquet", buf.getvalue())

    # the example's own nightly.yaml (the DAG's default job), pointed at the test's store and models
    recorder = _env_recorder(tmp_path / "seen")
    env = {
        "AIRFLOW_VAR_BATCHSPEC_BIN": str(recorder),
        "AIRFLOW_VAR_BATCHSPEC_NUM_WORKERS": "2",
        "BATCHSPEC_BUCKET": bucket,
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "BATCHSPEC_TARGET": str(MODELS / "target"),
        "BATCHSPEC_DRAFT": DRAFT["model"],
        "BATCHSPEC_MAX_MODEL_LEN": str(ENGINE["max_model_len"]),
        "BATCHSPEC_ENFORCE_EAGER": "true",
        "BATCHSPEC_DTYPE": ENGINE["dtype"],
        "BATCHSPEC_MAX_TOKENS": "8",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # each worker's engine in its batchspec process (4 s to start, not 28): what is tested
        # here is Airflow's side; the engine's own processes are the kill tests' (test_recovery)
        **INLINE_ENGINE,
        **NOT_FOR_BATCHSPEC,
    }
    done = airflow("dags", "test", DAG_ID, ds, env=env, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    states = _task_instances(airflow, ds)
    assert states == {
        ("plan_workers", -1): ("success", 1),
        ("run_worker", 0): ("success", 1),
        ("run_worker", 1): ("success", 1),
        ("check_status", -1): ("success", 1),
    }, states
    for index in range(2):  # each mapped task ran batchspec as its own worker
        assert f'"worker": "{index}/2"' in log, log[-6000:]
    assert "4 shards: {'committed': 4}" in log, log[-6000:]

    fs.invalidate_cache()
    outputs = sorted(k for k in fs.find(f"{bucket}/results/{ds}") if "/_batchspec/" not in k)
    assert len(outputs) == 4, outputs
    ids = [i for k in outputs for i in pq.read_table(io.BytesIO(fs.cat(k)))["request_id"].to_pylist()]
    assert sorted(ids) == sorted(expected)
    assert not fs.exists(f"{bucket}/results/2026-11-19")

    # batchspec saw what it needs and nothing else, in both the workers and the status check
    seen = {f.name: set(f.read_text().split()) for f in (tmp_path / "seen").glob("*.txt")}
    assert sorted(name.split("-")[0] for name in seen) == ["run", "run", "status"], sorted(seen)
    for name, names in seen.items():
        needed = {
            "PATH",
            "HOME",
            "DS",
            "BATCHSPEC_BUCKET",
            "S3_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "BATCHSPEC_TARGET",
            "BATCHSPEC_DRAFT",
            "VLLM_CPU_KVCACHE_SPACE",
        }
        assert needed <= names, (name, sorted(needed - names))
        assert not names & {
            *NOT_FOR_BATCHSPEC,
            "AIRFLOW_HOME",
            "AIRFLOW__CORE__DAGS_FOLDER",
            "AIRFLOW_VAR_BATCHSPEC_BIN",
        }, (name, sorted(names))
        extra = sorted(n for n in names if not ALLOWED_ENV.fullmatch(n))
        assert not extra, f"{name}: batchspec was given {extra}"
    # the task log names what it passed (Airflow appends " [logger] loc=FILE:LINE")
    logged = [line.split(" [")[0].split() for line in re.findall(r"environment passed: (.*)", log)]
    assert len(logged) >= 3 and {"PATH", "DS", "AWS_ACCESS_KEY_ID"} <= set(logged[0]), logged
    assert all(ALLOWED_ENV.fullmatch(n) for names in logged for n in names), logged


def test_bad_spec_fails_the_mapped_tasks_at_once_without_retry(airflow, tmp_path):
    ds = "2026-11-21"
    write_parquet(tmp_path / "in" / "part-0.parquet", {"prompt": ["a", "b"]})
    bad = write_job(
        tmp_path / "bad.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temprature": 0.0},
    )  # a misspelt SamplingParams key: exit 2
    env = {
        "AIRFLOW_VAR_BATCHSPEC_BIN": BATCHSPEC,
        "AIRFLOW_VAR_BATCHSPEC_JOB": str(bad),
        "AIRFLOW_VAR_BATCHSPEC_NUM_WORKERS": "2",
    }
    done = airflow("dags", "test", DAG_ID, ds, env=env, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode != 0, "a DAG run whose workers hit a bad spec must fail"
    states = _task_instances(airflow, ds)
    # max tries would be 2 (BATCHSPEC_RETRIES=1): try 1 and failed means exit 2 was not retried
    assert states[("run_worker", 0)] == ("failed", 1), states
    assert states[("run_worker", 1)] == ("failed", 1), states
    assert states[("check_status", -1)] == ("failed", 1), states  # status says exit 2 as well
    for index in range(2):
        starts = re.findall(rf"\[DAG TEST\] starting task_id=run_worker map_index={index}\b", log)
        assert len(starts) == 1, f"worker {index} started {len(starts)} times"
        assert f"worker {index}/2) exited 2 (bad job spec or command line): not retrying" in log
    assert "up_for_retry" not in log
    assert "temprature" in log, "the task log shows batchspec's message naming the bad key"
