"""What tests share besides fixtures: the repository's paths, the engine settings end-to-end
jobs use, job and Parquet writers, the CLI runner, the test store's credentials."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / ".models"

#: Engine settings every end-to-end job uses: eager mode starts in ~20 s on a CPU.
ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32"}
DRAFT = {"method": "draft_model", "model": str(MODELS / "draft"), "num_speculative_tokens": 4}
#: The EAGLE-3 head `make models` trains for the tiny target (batchspec distill --method eagle3).
HEAD = {"method": "eagle3", "model": str(MODELS / "head"), "num_speculative_tokens": 3}
#: n-gram lookup from a single matching token on (so that it proposes at most steps): the jobs
#: and probes with n-gram speculation share one engine (tests/helpers/shared_engines.py).
#: The tiny vision-language model's engine (tools/tiny_vlm.py): two images a prompt at most.
VLM_ENGINE = {**ENGINE, "max_model_len": 256, "limit_mm_per_prompt": {"image": 2}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


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


#: vLLM's switch for the engine's process shape. On the CPU build its default (1) starts an engine
#: core process and a worker process, each importing vLLM again (about 24 s of an engine's 28-s
#: start-up here); 0 runs both in the calling process (about 4 s). Jobs whose test is not about
#: the engine's processes run with 0 (:data:`INLINE_ENGINE`); the tests that kill runs, the Ray
#: replicas and the example deployments keep vLLM's default, the shape a production run has.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
INLINE_ENGINE = {MULTIPROCESSING_ENV: "0"}
SEPARATE_ENGINE = {MULTIPROCESSING_ENV: "1"}


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run the `batchspec` console script as a scheduler would, capturing its output. Its engine,
    if it starts one, runs in its own process (:data:`INLINE_ENGINE`) unless ``env`` says
    otherwise."""
    exe = Path(sys.executable).with_name("batchspec")
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **INLINE_ENGINE, **(env or {})}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT
    )


class EngineStarted(AssertionError):
    """A command run by :func:`run_cli_in_process` went as far as starting an engine."""


def run_cli_in_process(
    *args: str, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``batchspec ARGS`` in this process, for a command that ends before any engine starts (a
    refused spec, a planning error, `validate`, `status`, `report`): the console script's own
    entry point (``batchspec.cli:main``) with its exit code and what it wrote to file descriptors
    1 and 2, without paying vLLM's import (10-30 s) again in a new process. A command that starts
    an engine fails the test (:class:`EngineStarted`): that belongs in :func:`run_cli`. The
    environment, the working directory, the signal handlers and batchspec's logger are put back
    afterwards; each exit code keeps at least one real console-script run elsewhere."""
    import logging
    import signal
    import tempfile

    import batchspec.engine.llm as llm
    from batchspec.cli import main

    environ, cwd_before = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    logger = logging.getLogger("batchspec")
    log_state = (list(logger.handlers), logger.level)
    engine_for = llm.engine_for
    started = []

    def no_engine(*a, **k):
        started.append(True)
        raise EngineStarted(f"batchspec {' '.join(args)} started an engine: use run_cli")

    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(os.dup(1), "w", buffering=1, closefd=True)
        sys.stderr = open(os.dup(2), "w", buffering=1, closefd=True)
        os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", **INLINE_ENGINE, **(env or {})})
        llm.engine_for = no_engine
        code = 0
        try:
            os.chdir(cwd or ROOT)
            main.main(list(args), prog_name="batchspec", standalone_mode=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            llm.engine_for = engine_for
            for stream in (sys.stdout, sys.stderr):
                stream.close()
            sys.stdout, sys.stderr = saved[2], saved[3]
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.chdir(cwd_before)
            os.environ.clear()
            os.environ.update(environ)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            logger.handlers[:], logger.level = log_state
        if started:
            raise EngineStarted(f"batchspec {' '.join(args)} started an engine: use run_cli")
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return subprocess.CompletedProcess(["batchspec", *args], code, stdout, stderr)


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


def png_bytes(image) -> bytes:
    """A PIL image encoded as PNG."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
