"""Shared fixtures: the tiny model pair, prompt shards, job files, and a CLI runner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".models"
sys.path.insert(0, str(ROOT / "tools"))

#: Engine settings every end-to-end job uses: eager mode starts in ~20 s on a CPU.
ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}
DRAFT = {"method": "draft_model", "model": str(MODELS / "draft"), "num_speculative_tokens": 4}


def pytest_collection_modifyitems(items):
    """Mark every test that needs the built models, so `make test-fast` (no models, no engine)
    can leave them out on a fresh clone."""
    for item in items:
        if "models" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.models)


@pytest.fixture(scope="session")
def models() -> Path:
    """The tiny target/draft pair; `make models` builds it (make test does so first)."""
    for name in ("target", "draft"):
        if not (MODELS / name / ".batchspec-complete").exists():
            pytest.fail(f"{MODELS / name} is not built: run `make models` first")
    return MODELS


def write_job(path: Path, **sections) -> Path:
    """Write a job spec YAML from keyword sections (input=..., output=..., ...)."""
    spec = {"name": path.stem, "model": {"target": str(MODELS / "target"), "engine": dict(ENGINE)}}
    spec.update(sections)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def write_parquet(path: Path, columns: dict, schema: pa.Schema | None = None, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path, **kwargs)
    return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    """Run the `batchspec` console script as a scheduler would, capturing its output."""
    exe = Path(sys.executable).with_name("batchspec")
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or ROOT)


def read_output(out_dir: Path) -> pa.Table:
    """All committed output shards of a job, concatenated."""
    files = sorted(out_dir.glob("*.parquet"))
    assert files, f"no output files in {out_dir}"
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")


S3_KEY = "AKIABATCHSPECTEST"
S3_SECRET = "batchspec-test-secret-7f3a"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 (moto's server mode, as s3fs's own tests use).

    Yields ``(endpoint_url, storage_options)``; each test makes its own buckets."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint}}
    server.stop()
