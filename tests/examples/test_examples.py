"""examples/ run for real: the cron wrapper started twice at once, and the Kubernetes Indexed
Job's container command run locally once per index with the manifest's own environment (as
`kubectl apply -k` renders it), then its final status check, on the real engine and the tiny model
pair; the output is then checked row by row.

Without an engine: the cron wrapper's lock against squatters and planted symbolic links (with a
stand-in for the batchspec command, since only the wrapper's locking is under test), and the
Kubernetes manifests as a security reviewer reads them, with their worker count written once."""

from __future__ import annotations

import copy
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
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

BATCHSPEC = str(Path(sys.executable).with_name("batchspec"))
CRON = ROOT / "examples" / "cron" / "batchspec-cron"
K8S = ROOT / "examples" / "kubernetes"
#: Where the old wrapper put its lock when cron set no XDG_RUNTIME_DIR: a fixed, world-writable
#: directory and a name every local user can compute.
OLD_LOCK_DIR = Path("/tmp")


def _inputs(directory: Path, shards: int = 3, rows: int = 10) -> dict[str, list[str]]:
    from demo_data import prompt_table

    directory.mkdir(parents=True, exist_ok=True)
    expected = {}
    for i in range(shards):
        table = prompt_table(rows, seed=1200 + i, first_id=rows * i, max_tokens=(4, 16))
        pq.write_table(table, directory / f"part-{i}.parquet")
        expected[f"part-{i}"] = table["id"].to_pylist()
    return expected


@pytest.mark.engine
def test_cron_wrapper_never_overlaps_and_passes_the_exit_code(tmp_path, models):
    expected = _inputs(tmp_path / "in")
    job = write_job(
        tmp_path / "nightly.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"max_tokens": "max_tokens"},
        },
        output={"path": str(tmp_path / "out")},
        speculative=DRAFT,
        sampling={"temperature": 0.0, "max_tokens": 16},
    )
    # as cron starts it: no XDG_RUNTIME_DIR, so the lock is in the state directory (here in tmp_path)
    # the engine in batchspec's process (the wrapper's lock and exit code are under test, not the
    # engine's processes: tests/run/test_recovery.py has those)
    env = {
        **_cron_env(tmp_path / "state"),
        "BATCHSPEC": BATCHSPEC,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **INLINE_ENGINE,
    }
    wrapper = str(CRON)
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [wrapper, str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
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
    assert "not starting another" in busy_err and str(tmp_path / "state") in busy_err, busy_err
    logs = sorted((tmp_path / "state" / "batchspec" / "logs" / "nightly").glob("*.log"))
    assert len(logs) == 1, "the run that did not start must not leave a log"
    assert '"event": "run_finished"' in logs[0].read_text()
    kept = logs[0].with_name(logs[0].name.replace(".log", ".summary.json"))
    assert kept.exists() and '"status": "ok"' in kept.read_text()
    ids = [
        i
        for f in sorted((tmp_path / "out").glob("*.parquet"))
        for i in pq.read_table(f)["request_id"].to_pylist()
    ]
    assert sorted(ids) == sorted(i for v in expected.values() for i in v)
    # a bad spec's exit code comes through the wrapper unchanged
    bad = subprocess.run(
        [wrapper, str(job), "--set", "sampling.temprature=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2, bad.stderr


# ---------------------------------------------------------------------------- cron: the lock


def _cron_env(state: Path, **extra: str) -> dict[str, str]:
    """The environment cron gives the wrapper: no XDG_RUNTIME_DIR; the state directory (where the
    private lock directory and the logs go) in the test's own tmp_path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XDG_RUNTIME_DIR", "BATCHSPEC_LOCK", "BATCHSPEC_LOG_DIR")
    }
    return {**env, "XDG_STATE_HOME": str(state), **extra}


@pytest.fixture
def cron(tmp_path):
    """Runs the cron wrapper with a stand-in for the batchspec command (only the wrapper's lock is
    under test): it records that it was started and waits while the file ``hold`` exists. Returns
    (job, a function starting the wrapper, the stand-in's record file)."""
    stand_in = tmp_path / "batchspec"
    ran = tmp_path / "ran"
    stand_in.write_text(f"""#!/bin/sh
echo "$*" >> '{ran}'
while [ -e '{tmp_path / "hold"}' ]; do sleep 0.05; done
echo '{{"event": "run_finished", "message": "ok: stand-in"}}' >&2
""")
    stand_in.chmod(0o755)
    # a name no other test (and no earlier run) uses: the old wrapper's lock name derives from it
    job = tmp_path / f"cron-{os.getpid()}-{tmp_path.name}.yaml"
    job.write_text("name: x\n")

    def start(*, wait: bool = True, **env: str):
        args = [str(CRON), str(job)]
        full = {**_cron_env(tmp_path / "state"), "BATCHSPEC": str(stand_in), **env}
        if wait:
            return subprocess.run(args, env=full, capture_output=True, text=True, timeout=60)
        return subprocess.Popen(args, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return job, start, ran


def _lock_name(job: Path) -> str:
    """The wrapper's lock file name for ``job``: computable by anyone who knows the job's path."""
    key = subprocess.run(
        ["cksum"], input=str(job.resolve()), capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return f"batchspec-{job.stem}-{key}.lock"


def test_cron_lock_cannot_be_squatted_or_redirected_from_a_shared_directory(cron, tmp_path):
    job, start, ran = cron
    squat = OLD_LOCK_DIR / _lock_name(job)
    victim = tmp_path / "victim"  # what a planted link points at: must never be created
    try:
        # another user's file at the old, computable name, locked by a process of theirs
        with open(squat, "w") as held:
            if os.geteuid() == 0:
                os.chown(squat, 65534, 65534)  # nobody's
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            done = start()
        assert done.returncode == 0, done.stderr  # the old wrapper exited 75 here, every night
        assert ran.read_text().startswith("run "), "the job did not run"
        # a symbolic link planted at the same name is not followed
        squat.unlink()
        squat.symlink_to(victim)
        done = start()
        assert done.returncode == 0, done.stderr
        assert not victim.exists(), "the lock followed a link planted in a shared directory"
        assert len(ran.read_text().splitlines()) == 2
    finally:
        if squat.is_symlink() or squat.exists():
            squat.unlink()
    # the lock is in a directory of this user's own, which nobody else can write to
    locks = tmp_path / "state" / "batchspec" / "locks"
    st = locks.lstat()
    assert locks.is_dir() and not locks.is_symlink() and st.st_uid == os.geteuid()
    assert st.st_mode & 0o777 == 0o700, oct(st.st_mode)
    assert [p.name for p in locks.iterdir()] == [_lock_name(job)]


def test_cron_lock_still_stops_a_second_run_of_the_same_job(cron, tmp_path):
    job, start, ran = cron
    (tmp_path / "hold").touch()
    first = start(wait=False)
    try:
        deadline = time.monotonic() + 30
        while not ran.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ran.exists(), "the first run did not start"
        second = start()
        assert second.returncode == 75, second.stderr
        assert "still holds" in second.stderr and str(tmp_path / "state") in second.stderr
    finally:
        (tmp_path / "hold").unlink()
        first.communicate(timeout=30)
    assert first.returncode == 0
    assert len(ran.read_text().splitlines()) == 1, "the second run started the job"
    # a safe XDG_RUNTIME_DIR (this user's, 0700) is where the lock goes when there is one
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    assert start(XDG_RUNTIME_DIR=str(runtime)).returncode == 0
    assert [p.name for p in runtime.iterdir()] == [_lock_name(job)]
    # an unsafe one (group- and world-writable) is not used: the private state directory is
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = start(XDG_RUNTIME_DIR=str(shared))
    assert done.returncode == 0 and "not using XDG_RUNTIME_DIR" in done.stderr, done.stderr
    assert list(shared.iterdir()) == []


def _unsafe(kind: str, tmp_path: Path) -> dict[str, str]:
    """Environment for the wrapper whose lock would be somewhere unsafe, by ``kind``."""
    locks = tmp_path / "state" / "batchspec" / "locks"
    locks.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if kind == "locks dir is a symlink":
        locks.symlink_to(elsewhere)
    elif kind == "locks dir is group/other-writable":
        locks.mkdir()
        locks.chmod(0o777)
    elif kind == "locks dir owned by another user":
        locks.mkdir(mode=0o700)
        os.chown(locks, 65534, 65534)
    elif kind == "lock file is a symlink":
        locks.mkdir(mode=0o700)
        return {"__plant__": str(locks)}
    elif kind == "BATCHSPEC_LOCK in a world-writable directory":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        return {"BATCHSPEC_LOCK": str(shared / "job.lock")}
    elif kind == "BATCHSPEC_LOCK is a symlink":
        (elsewhere / "job.lock").symlink_to(tmp_path / "victim")
        return {"BATCHSPEC_LOCK": str(elsewhere / "job.lock")}
    return {}


@pytest.mark.parametrize(
    "kind",
    [
        "locks dir is a symlink",
        "locks dir is group/other-writable",
        "locks dir owned by another user",
        "lock file is a symlink",
        "BATCHSPEC_LOCK in a world-writable directory",
        "BATCHSPEC_LOCK is a symlink",
    ],
)
def test_cron_refuses_an_unsafe_lock(cron, tmp_path, kind):
    if kind == "locks dir owned by another user" and os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    job, start, ran = cron
    env = _unsafe(kind, tmp_path)
    planted = env.pop("__plant__", None)
    if planted:  # at the very name the wrapper would use
        (Path(planted) / _lock_name(job)).symlink_to(tmp_path / "victim")
    done = start(**env)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "batchspec-cron: refusing" in done.stderr, done.stderr
    assert not ran.exists(), "the job ran with an unsafe lock"
    assert not (tmp_path / "victim").exists()
    assert list((tmp_path / "elsewhere").iterdir()) in ([], [tmp_path / "elsewhere" / "job.lock"])


# ---------------------------------------------------------------------------- Kubernetes


def _kustomize(docs: list[dict], kustomization: dict) -> list[dict]:
    """What `kubectl apply -k` sends for ``docs``: the kustomization's replacements applied (the
    part of kustomize the example uses: a source field copied to target field paths, ``[name=x]``
    picking a list item by name; a number copied into a string field becomes a string, as
    kustomize writes it)."""
    docs = copy.deepcopy(docs)

    def pick(select: dict) -> dict:
        return next(
            d for d in docs if d["kind"] == select["kind"] and d["metadata"]["name"] == select["name"]
        )

    def walk(node, path: str):
        parts = path.split(".")
        for part in parts[:-1]:
            m = re.fullmatch(r"\[(\w+)=(.+)\]", part)
            node = next(i for i in node if i[m[1]] == m[2]) if m else node[part]
        return node, parts[-1]

    for rep in kustomization.get("replacements", []):
        node, key = walk(pick(rep["source"]), rep["source"]["fieldPath"])
        value = node[key]
        for target in rep["targets"]:
            for path in target["fieldPaths"]:
                node, key = walk(pick(target["select"]), path)
                node[key] = str(value) if isinstance(node.get(key), str) else value
    return docs


def _k8s_docs(completions: int | None = None) -> tuple[list[dict], list[dict]]:
    """(the worker manifests as `kubectl apply -k examples/kubernetes/` renders them, with the
    Job's completions set to ``completions`` if given; the status check's manifests)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [d for r in kustomization["resources"] for d in yaml.safe_load_all((K8S / r).read_text())]
    if completions is not None:
        next(d for d in docs if d["kind"] == "Job")["spec"]["completions"] = completions
    status = list(yaml.safe_load_all((K8S / "batchspec-status.yaml").read_text()))
    return _kustomize(docs, kustomization), status


def _quantity(q: str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i)?", str(q))
    assert m, f"unexpected quantity {q!r}"
    return int(m[1]) * 1024 ** " KMGT".index(m[2][0] if m[2] else " ")


def _container_env(container: dict, docs: list[dict]) -> dict[str, str | None]:
    """A container's environment: its envFrom ConfigMaps, then its env (None: from a Secret)."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {}
    for ref in container.get("envFrom", []):
        env.update(maps[ref["configMapRef"]["name"]])
    env.update({e["name"]: e.get("value") for e in container.get("env", [])})
    return env


def test_kubernetes_manifests_pass_a_security_review():
    workers, status = _k8s_docs()
    docs = workers + status
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert sorted(j["metadata"]["name"] for j in jobs) == ["batchspec-nightly", "batchspec-nightly-status"]
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        name = job["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0 and psc["runAsGroup"] > 0, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert not any("hostPath" in v for v in volumes.values()), name
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc.get("runAsUser", psc["runAsUser"]) > 0, name
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            # what batchspec writes (TMPDIR: the spool and the engine log; HOME: caches) is on
            # writable, size-limited emptyDirs; everything else it reads is mounted read-only
            env = _container_env(c, docs)
            for var in ("TMPDIR", "HOME"):
                mount = mounts[env[var]]
                volume = volumes[mount["name"]]
                assert "sizeLimit" in volume["emptyDir"] and not mount.get("readOnly"), (name, var)
            for m in mounts.values():
                volume = volumes[m["name"]]
                assert "emptyDir" in volume or m.get("readOnly") is True, (name, m)
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["readOnly"] is True, (name, m)
            # ephemeral storage requested and limited, the limit covering its disk emptyDirs
            disk = sum(
                _quantity(volumes[m["name"]]["emptyDir"]["sizeLimit"])
                for m in mounts.values()
                if "emptyDir" in volumes[m["name"]]
                and volumes[m["name"]]["emptyDir"].get("medium") != "Memory"
            )
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert 0 < _quantity(requests["ephemeral-storage"]) <= _quantity(limits["ephemeral-storage"])
            assert _quantity(limits["ephemeral-storage"]) >= disk, name
            assert "memory" in limits, name
            # credentials only from the Secret, never written into the manifest
            assert all(v is None for k, v in env.items() if k.startswith("AWS_")), name
        # exit 2 (bad spec) and 3 (bad input) are never retried
        rule = job["spec"]["podFailurePolicy"]["rules"][0]
        assert rule["onExitCodes"]["values"] == [2, 3] and rule["action"] in ("FailIndex", "FailJob")
    # the status check sees what the workers see: the same spec, environment and models
    worker = next(j for j in workers if j["kind"] == "Job")["spec"]["template"]["spec"]
    check = next(j for j in status if j["kind"] == "Job")["spec"]["template"]["spec"]
    assert [v for v in check["volumes"] if "emptyDir" not in v] == [
        v for v in worker["volumes"] if "emptyDir" not in v
    ]
    shared = {
        k: v for k, v in _container_env(worker["containers"][0], docs).items() if k != "BATCHSPEC_NUM_WORKERS"
    }
    assert _container_env(check["containers"][0], docs) == shared


def test_kubernetes_spool_is_where_the_manifest_gives_room(tmp_path):
    """batchspec spools object-store output (and writes its engine log) under TMPDIR, the
    manifest's size-limited emptyDir: checked against batchspec itself, not taken on trust."""
    spool = tmp_path / "tmp"
    spool.mkdir()
    code = (
        "import tempfile; from batchspec.io.output_dir import spool_dir; "
        "print(spool_dir()); print(tempfile.mkstemp(prefix='batchspec-')[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TMPDIR": str(spool)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert all(Path(p).parent == spool for p in done.stdout.split()), done.stdout


def test_kubernetes_worker_count_is_written_once(tmp_path):
    raw = [d for d in yaml.safe_load_all((K8S / "batchspec-job.yaml").read_text())]
    raw_job = next(d for d in raw if d["kind"] == "Job")
    count = raw_job["spec"]["completions"]
    assert raw_job["spec"]["completionMode"] == "Indexed" and count >= 1
    container = raw_job["spec"]["template"]["spec"]["containers"][0]
    args = container["command"] + container.get("args", [])
    assert not any(a.startswith(("--num-workers", "--worker-index")) for a in args), args
    # applied without -k, the count in the pods is no number: every pod exits 2 at once (and
    # exit 2 fails its index without retries), never a green Job that left shards out
    unrendered = {e["name"]: e.get("value") for e in container["env"]}["BATCHSPEC_NUM_WORKERS"]
    assert not unrendered.strip().isdigit()
    bad = subprocess.run(
        [BATCHSPEC, "run", str(tmp_path / "job.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BATCHSPEC_NUM_WORKERS": unrendered},
    )
    assert bad.returncode == 2 and "--num-workers" in bad.stderr, bad.stderr
    # rendered, every count follows spec.completions: change it there and nowhere else
    for n in (count, 1, 3, 8):
        workers, _ = _k8s_docs(completions=n)
        job = next(d for d in workers if d["kind"] == "Job")
        env = _container_env(job["spec"]["template"]["spec"]["containers"][0], workers)
        assert job["spec"]["completions"] == n and job["spec"]["parallelism"] == n
        assert env["BATCHSPEC_NUM_WORKERS"] == str(n)
    # where kubectl is installed, its own kustomize renders what the test above assumes
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert list(yaml.safe_load_all(out.stdout)) == _k8s_docs()[0]


def test_kubernetes_status_check_fails_while_shards_are_pending(tmp_path):
    """The final check's script from the ConfigMap, on a job nothing has run yet: exit 1 naming
    every shard (the engine test below sees it name only the shards left, then pass)."""
    workers, _ = _k8s_docs()
    script = tmp_path / "check-status.py"
    script.write_text(
        next(d for d in workers if d["metadata"]["name"] == "batchspec-nightly")["data"]["check-status.py"]
    )
    for i in range(2):
        write_parquet(tmp_path / "in" / f"part-{i}.parquet", {"prompt": ["a", "b"]})
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
    )
    env = {**os.environ, "PATH": f"{Path(BATCHSPEC).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, str(script), str(job)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 shards: {'pending': 2}" in done.stdout
    assert "2 of 2 shards not committed: part-0, part-1" in done.stderr
    # no input at all is batchspec's own exit 3, passed through (the Job does not retry it)
    for f in (tmp_path / "in").iterdir():
        f.unlink()
    done = subprocess.run(
        [sys.executable, str(script), str(job)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3 and "no input shards" in done.stderr, done.stdout + done.stderr


@pytest.mark.engine
def test_kubernetes_indexed_job_covers_every_row_once(tmp_path, models, s3_server):
    """The workers' container, once per index, with the environment and files the rendered
    manifest gives it (emptyDirs as fresh directories); then the final status check, which fails
    naming what is left while an index has not run (what a worker count lowered in one place
    would leave) and passes once every shard is committed."""
    import s3fs
    from demo_data import prompt_table

    endpoint, options = s3_server
    workers, status = _k8s_docs()
    config = next(d for d in workers if d["metadata"]["name"] == "batchspec-nightly")
    spec = next(d for d in workers if d["kind"] == "Job")["spec"]
    container = spec["template"]["spec"]["containers"][0]
    check = next(d for d in status if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    etc = tmp_path / "etc"  # the ConfigMap's files, mounted at /etc/batchspec in the pods
    etc.mkdir()
    for name, text in config["data"].items():
        (etc / name).write_text(text)
    # stand-ins for what the manifest gives, here: its emptyDir /tmp, the Secret, the store, the
    # models; HOME stays this machine's, whose caches spare vLLM a model inspection at start-up
    local = {
        "TMPDIR": str(tmp_path / "tmp"),
        "HOME": os.environ["HOME"],
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "BATCHSPEC_TARGET": str(MODELS / "target"),
        "BATCHSPEC_DRAFT": DRAFT["model"],
        "BATCHSPEC_MAX_MODEL_LEN": str(ENGINE["max_model_len"]),
        "BATCHSPEC_ENFORCE_EAGER": "true",
        "BATCHSPEC_DTYPE": ENGINE["dtype"],
        "BATCHSPEC_MAX_TOKENS": "16",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **INLINE_ENGINE,  # each pod's engine in its batchspec process: 4 s to start, not 28
        "PATH": f"{Path(BATCHSPEC).parent}{os.pathsep}{os.environ['PATH']}",
    }
    Path(local["TMPDIR"]).mkdir()

    def pod(c: dict, **extra: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in _container_env(c, workers).items() if v is not None}
        command = [
            sys.executable
            if a == "python3"
            else BATCHSPEC
            if a == "batchspec"
            else str(etc / a.removeprefix("/etc/batchspec/"))
            if a.startswith("/etc/batchspec/")
            else a
            for a in c["command"]
        ]
        return subprocess.run(
            command,
            env={**os.environ, **env, **local, **extra},
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )

    env = _container_env(container, workers)
    fs = s3fs.S3FileSystem(**options)
    bucket = env["BATCHSPEC_BUCKET"]
    fs.mkdir(bucket)
    expected = {}
    for i in range(4):
        table = prompt_table(8, seed=1300 + i, first_id=8 * i, max_tokens=(4, 16))
        buf = io.BytesIO()
        pq.write_table(table, buf)
        fs.pipe(f"{bucket}/prompts/{env['DS']}/part-{i}.parquet", buf.getvalue())
        expected[f"part-{i}"] = table["id"].to_pylist()

    count = spec["completions"]
    for index in range(count):
        run = pod(container, JOB_COMPLETION_INDEX=str(index))
        assert run.returncode == 0, run.stderr[-3000:]
        assert f'"worker": "{index}/{count}"' in run.stderr
        if index == 0:  # one index done, one not: the final check fails and names what is left
            done = pod(check)
            assert done.returncode == 1, done.stdout + done.stderr
            fs.invalidate_cache()
            manifests = fs.find(f"{bucket}/results/{env['DS']}/_batchspec/manifest")
            committed = {k.rsplit("/", 1)[-1].removesuffix(".json") for k in manifests}
            left = sorted(set(expected) - committed)
            assert committed and left, (committed, left)
            assert f"{len(left)} of 4 shards not committed: {', '.join(left)}" in done.stderr, done.stderr
    done = pod(check)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 shards: {'committed': 4}" in done.stdout
    fs.invalidate_cache()
    outputs = sorted(k for k in fs.find(f"{bucket}/results/{env['DS']}") if "/_batchspec/" not in k)
    ids = [i for k in outputs for i in pq.read_table(io.BytesIO(fs.cat(k)))["request_id"].to_pylist()]
    assert sorted(ids) == sorted(i for v in expected.values() for i in v)
    assert len(outputs) == 4
    assert list(Path(local["TMPDIR"]).glob("batchspec-*.engine.log")), "the engine log is in TMPDIR"
