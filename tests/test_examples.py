"""examples/ run for real: the cron wrapper started twice at once, and the Kubernetes Indexed
Job's container command run locally once per index with the manifest's own environment, on the
real engine and the tiny model pair; the output is then checked row by row."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DRAFT, ENGINE, MODELS, ROOT, S3_KEY, S3_SECRET, write_job

pytestmark = pytest.mark.engine
BATCHSPEC = str(Path(sys.executable).with_name("batchspec"))


def _inputs(directory: Path, shards: int = 3, rows: int = 10) -> dict[str, list[str]]:
    from demo_data import prompt_table

    directory.mkdir(parents=True, exist_ok=True)
    expected = {}
    for i in range(shards):
        table = prompt_table(rows, seed=1200 + i, first_id=rows * i, max_tokens=(4, 16))
        pq.write_table(table, directory / f"part-{i}.parquet")
        expected[f"part-{i}"] = table["id"].to_pylist()
    return expected


def test_cron_wrapper_never_overlaps_and_passes_the_exit_code(tmp_path, models):
    expected = _inputs(tmp_path / "in")
    job = write_job(tmp_path / "nightly.yaml",
                    input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt",
                           "id_column": "id", "sampling_columns": {"max_tokens": "max_tokens"}},
                    output={"path": str(tmp_path / "out")}, speculative=DRAFT,
                    sampling={"temperature": 0.0, "max_tokens": 16})
    env = {**os.environ, "BATCHSPEC": BATCHSPEC, "BATCHSPEC_LOG_DIR": str(tmp_path / "logs"),
           "BATCHSPEC_LOCK": str(tmp_path / "nightly.lock"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    wrapper = str(ROOT / "examples" / "cron" / "batchspec-cron")
    started = time.monotonic()
    procs = [subprocess.Popen([wrapper, str(job)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() - started < 600:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.1)
    results = sorted((p.returncode, p.communicate()[1], ended[i]) for i, p in enumerate(procs))
    (ok_rc, ok_err, _), (busy_rc, busy_err, busy_s) = results
    assert ok_rc == 0, ok_err
    assert busy_rc == 75 and "still holds" in busy_err and busy_s < 10, busy_err
    logs = sorted((tmp_path / "logs" / "nightly").glob("*.log"))
    assert len(logs) == 1, "the run that did not start must not leave a log"
    assert '"event": "run_finished"' in logs[0].read_text()
    kept = logs[0].with_name(logs[0].name.replace(".log", ".summary.json"))
    assert kept.exists() and '"status": "ok"' in kept.read_text()
    ids = [i for f in sorted((tmp_path / "out").glob("*.parquet"))
           for i in pq.read_table(f)["request_id"].to_pylist()]
    assert sorted(ids) == sorted(i for v in expected.values() for i in v)
    # a bad spec's exit code comes through the wrapper unchanged
    bad = subprocess.run([wrapper, str(job), "--set", "sampling.temprature=1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr


def test_kubernetes_indexed_job_covers_every_row_once(tmp_path, models, s3_server):
    import s3fs

    endpoint, options = s3_server
    docs = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "batchspec-job.yaml").read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    k8s_job = next(d for d in docs if d["kind"] == "Job")
    spec = k8s_job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(config["data"]["job.yaml"])

    fs = s3fs.S3FileSystem(**options)
    bucket = env["BATCHSPEC_BUCKET"]
    fs.mkdir(bucket)
    expected = {}
    from demo_data import prompt_table

    for i in range(4):
        table = prompt_table(8, seed=1300 + i, first_id=8 * i, max_tokens=(4, 16))
        buf = io.BytesIO()
        pq.write_table(table, buf)
        fs.pipe(f"{bucket}/prompts/{env['DS']}/part-{i}.parquet", buf.getvalue())
        expected[f"part-{i}"] = table["id"].to_pylist()

    command = [BATCHSPEC if c == "batchspec" else str(job_file) if c == "/etc/batchspec/job.yaml"
               else c for c in container["command"]]
    local = {"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
             "AWS_SECRET_ACCESS_KEY": S3_SECRET, "BATCHSPEC_TARGET": str(MODELS / "target"),
             "BATCHSPEC_DRAFT": DRAFT["model"], "BATCHSPEC_MAX_MODEL_LEN": str(ENGINE["max_model_len"]),
             "BATCHSPEC_ENFORCE_EAGER": "true", "BATCHSPEC_DTYPE": ENGINE["dtype"],
             "VLLM_CPU_KVCACHE_SPACE": "1"}
    for index in range(spec["completions"]):
        run = subprocess.run(command, env={**os.environ, **env, **local,
                                           "JOB_COMPLETION_INDEX": str(index)},
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f'"worker": "{index}/{spec["completions"]}"' in run.stderr
    fs.invalidate_cache()
    outputs = sorted(k for k in fs.find(f"{bucket}/results/{env['DS']}") if "/_batchspec/" not in k)
    ids = [i for k in outputs for i in pq.read_table(io.BytesIO(fs.cat(k)))["request_id"].to_pylist()]
    assert sorted(ids) == sorted(i for v in expected.values() for i in v)
    assert len(outputs) == 4
