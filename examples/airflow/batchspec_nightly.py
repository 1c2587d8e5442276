"""A nightly batchspec job as an Airflow 3 DAG: one mapped task per worker, then a status check.

    plan_workers  ->  run_worker[0..N-1]  (dynamic task mapping; map index = worker index)
                  ->  check_status        (fails while any shard is not committed)

Each mapped task runs ``batchspec run JOB --worker-index I --num-workers N`` as a subprocess; the
job's shards are split between the workers by name, so N tasks cover every shard once, and a
retried task skips what it already committed. Exit codes keep their CONTRACT meaning: 1 (engine
died, storage failed) is retried with the task's retries; 2 (bad spec) and 3 (bad input) fail the
task at once, since a retry would fail the same way. The run's date reaches the spec as ``${DS}``
(see nightly.yaml): the task's ``job_env`` is rendered by Airflow (``{{ ds }}``) and passed to
batchspec in its environment.

batchspec gets an allow-listed environment, never the worker's whole one (Airflow's own settings
such as the metadata database URL and secret keys, its connections and variables, whatever else
the worker holds): ``PATH``, ``HOME``, locale, ``TMPDIR``, proxy and CA-bundle settings; every
``${VAR}`` the job spec names (and ``DS`` from the DAG); ``BATCHSPEC_*``, ``VLLM_*``, ``HF_*`` and
the GPU's ``CUDA_*``/``NVIDIA_*``/``NCCL_*``; and the credentials of the stores the job names:
``AWS_*`` for ``s3://``, ``GOOGLE_*`` for ``gs://``, ``AZURE_*`` for ``az://``/``abfs://``. Anything
else it needs goes in the ``batchspec_pass_env`` Variable. Each task logs the names it passes (never
the values).

Configuration, read when a task runs (Airflow Variables, or ``AIRFLOW_VAR_<NAME>`` in the workers'
environment):

    batchspec_bin          the batchspec command (default: ``batchspec`` on PATH)
    batchspec_job          the job spec (default: nightly.yaml beside this file)
    batchspec_num_workers  how many mapped workers (default 2); each needs one GPU, so put
                           run_worker in a pool the size of your GPU count
    batchspec_pass_env     more environment variables batchspec may see, comma-separated
                           (default: none beyond the allow-list above)

and, when the DAG file is parsed: ``BATCHSPEC_RETRIES`` (default 2) and ``BATCHSPEC_RETRY_DELAY_S``
(default 300) for exit code 1.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

from airflow.sdk import TriggerRule, Variable, dag, task
from airflow.sdk.exceptions import AirflowFailException

log = logging.getLogger(__name__)

#: batchspec's exit codes that no retry can fix (docs/contract.md): fail the task at once.
NOT_RETRYABLE = {2: "bad job spec or command line", 3: "bad input data"}
#: Seconds a stopped task gives batchspec to finish its in-flight requests and exit cleanly.
GRACE_S = 60
#: The environment the spec's ${VAR}s read; Airflow renders the templates for each run.
JOB_ENV = {"DS": "{{ ds }}"}
#: What batchspec may see of the worker's environment, by name and by prefix (see the docstring).
PASS_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "XDG_CACHE_HOME",
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    }
)
PASS_PREFIXES = ("BATCHSPEC_", "VLLM_", "HF_", "CUDA_", "NVIDIA_", "NCCL_")
#: Credentials by the stores a job names: a job on S3 gets AWS_*, never Google's or Azure's.
STORE_PREFIXES = {
    ("s3://", "s3a://"): ("AWS_",),
    ("gs://", "gcs://"): ("GOOGLE_", "GCLOUD_", "CLOUDSDK_"),
    ("az://", "abfs://", "abfss://", "adl://"): ("AZURE_",),
}
_SPEC_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _config(job_env: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    """The batchspec command, the job spec path and batchspec's environment, from Variables or
    their defaults."""
    binary = Variable.get("batchspec_bin", default="batchspec")
    job = Variable.get("batchspec_job", default=str(Path(__file__).with_name("nightly.yaml")))
    extra = Variable.get("batchspec_pass_env", default="")
    return binary, job, batchspec_env(job, job_env, extra)


def batchspec_env(
    job: str, job_env: dict[str, str], extra: str = "", environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment batchspec runs with: the allow-listed part of ``environ`` (the worker's),
    the spec's own ``${VAR}``s, the credentials of the stores it names, ``extra`` (comma-separated
    names), then ``job_env`` (the rendered ``DS``)."""
    environ = dict(os.environ if environ is None else environ)
    try:
        text = Path(job).read_text()
    except OSError:  # batchspec itself says so (exit 2)
        text = ""
    names = PASS_NAMES | set(_SPEC_VAR.findall(text))
    names |= {n.strip() for n in extra.split(",") if n.strip()}
    # the stores a job names: in the spec's text, or in the ${VAR}s it reads (input: ${URL})
    where = " ".join([text, *(environ.get(n, "") for n in names), *job_env.values()])
    prefixes = PASS_PREFIXES + tuple(
        p for schemes, ps in STORE_PREFIXES.items() if any(s in where for s in schemes) for p in ps
    )
    env = {k: v for k, v in environ.items() if k in names or k.startswith(prefixes)}
    return {**env, **job_env}


def _stream(args: list[str], env: dict[str, str], what: str) -> tuple[int, dict]:
    """Run ``batchspec run``, streaming its output (JSON events) into the task log; return its exit
    code and its ``run_finished`` event. If Airflow stops the task, batchspec gets SIGTERM and
    ``GRACE_S`` to abort in-flight requests, commit nothing partial and exit, not an orphan."""
    log.info("%s: %s", what, " ".join(args))
    log.info("environment passed: %s", " ".join(sorted(env)))
    finished: dict = {}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            log.info("%s", line.rstrip())
            if '"event": "run_finished"' in line:
                try:
                    finished = json.loads(line)
                except ValueError:  # not one of batchspec's own lines: keep the log, skip the XCom
                    pass
        return proc.wait(), finished
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()


def _raise_for(code: int, what: str) -> None:
    """Turn batchspec's exit code into the task's outcome: 0 passes, 2 and 3 fail without retry,
    anything else (1, a signal) fails the try and leaves retrying to the task's retries."""
    if code == 0:
        return
    if code in NOT_RETRYABLE:
        raise AirflowFailException(
            f"{what} exited {code} ({NOT_RETRYABLE[code]}): not retrying, "
            f"fix the spec or the data and clear the task"
        )
    raise RuntimeError(f"{what} exited {code}: retrying if tries are left (a rerun skips committed shards)")


@dag(
    dag_id="batchspec_nightly",
    schedule="15 2 * * *",
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,  # two runs of one job would only wait on each other's shard leases
    tags=["batchspec"],
    doc_md=__doc__,
)
def batchspec_nightly() -> None:
    """The DAG: plan the workers, run them mapped, then check every shard is committed."""

    @task
    def plan_workers() -> list[dict[str, int]]:
        """One mapped run_worker per worker index, the count read when the run starts."""
        num_workers = int(Variable.get("batchspec_num_workers", default="2"))
        if num_workers < 1:
            raise AirflowFailException(f"batchspec_num_workers must be at least 1, not {num_workers}")
        return [{"worker_index": i, "num_workers": num_workers} for i in range(num_workers)]

    @task(
        retries=int(os.environ.get("BATCHSPEC_RETRIES", "2")),
        retry_delay=timedelta(seconds=float(os.environ.get("BATCHSPEC_RETRY_DELAY_S", "300"))),
        retry_exponential_backoff=True,
    )
    def run_worker(worker_index: int, num_workers: int, job_env: dict[str, str]) -> dict:
        """``batchspec run`` for one worker's shards; returns its ``run_finished`` event (rows,
        errors, wall time, the run summary's path) as the task's XCom."""
        binary, job, env = _config(job_env)
        what = f"batchspec run (worker {worker_index}/{num_workers})"
        code, finished = _stream(
            [
                binary,
                "run",
                job,
                "--worker-index",
                str(worker_index),
                "--num-workers",
                str(num_workers),
                "--log-format",
                "json",
            ],
            env,
            what,
        )
        _raise_for(code, what)
        return finished

    @task(
        trigger_rule=TriggerRule.ALL_DONE,
        retries=int(os.environ.get("BATCHSPEC_RETRIES", "2")),
        retry_delay=timedelta(seconds=30),
    )
    def check_status(job_env: dict[str, str]) -> dict[str, int]:
        """``batchspec status`` over the whole job: fails while any shard is not committed, so the
        run is green only when every row is in the output. Runs after failed workers too, to say
        which shards are left."""
        binary, job, env = _config(job_env)
        args = [binary, "status", job, "--format", "json"]
        log.info("batchspec status: %s", " ".join(args))
        log.info("environment passed: %s", " ".join(sorted(env)))
        done = subprocess.run(args, env=env, capture_output=True, text=True)
        for line in done.stderr.splitlines():
            log.info("%s", line)
        _raise_for(done.returncode, "batchspec status")
        shards = [s for s in json.loads(done.stdout) if s["state"] != "orphan"]
        counts: dict[str, int] = {}
        for s in shards:
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        log.info("%d shards: %s", len(shards), counts)
        left = sorted(s["shard"] for s in shards if s["state"] != "committed")
        if left:
            # not worth a retry: only rerunning the workers (clear the failed ones) commits them
            raise AirflowFailException(
                f"{len(left)} of {len(shards)} shards not committed ({counts}): {', '.join(left[:20])}"
            )
        return counts

    workers = run_worker.partial(job_env=JOB_ENV).expand_kwargs(plan_workers())
    workers >> check_status(job_env=JOB_ENV)


batchspec_nightly()
