"""What every command shares: the --set option, loading the job (exit 2 on a bad spec), the one
error exit, and keeping vLLM's own output off the terminal."""

from __future__ import annotations

import logging
import os
import sys

import click

from batchspec.errors import BatchspecError, RuntimeFailure, SpecError
from batchspec.redact import scrub_text
from batchspec.run.events import EventLog
from batchspec.spec.load import load_spec


def quiet_vllm(verbose: bool, log_format: str = "text") -> None:
    """Keep vLLM's own log noise at warning level (error level with JSON logs, so that
    schedulers parse whole lines) unless --verbose."""
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if log_format == "json" else "WARNING")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    ours = logging.getLogger("batchspec")
    ours.addHandler(handler)
    ours.setLevel(logging.INFO if verbose else logging.WARNING)


def engine_log_file(run_id: str) -> tuple[object, str]:
    """Keep stderr for batchspec's own lines (text or JSON): third-party output (vLLM's engine
    processes, torch's C++ warnings, progress bars of model loading) goes to a log file, named
    in the first event and in engine errors. Returns (batchspec's stream, log path)."""
    import tempfile

    stream = os.fdopen(os.dup(2), "w", buffering=1)
    # mkstemp: a new file (O_EXCL, so never through a planted symlink) with an unguessable
    # name, readable by this user only (0600)
    fd, path = tempfile.mkstemp(prefix=f"batchspec-{run_id}-", suffix=".engine.log")
    sys.stdout.flush()
    os.dup2(fd, 1)  # vLLM's loggers and its engine processes write to stdout
    os.dup2(fd, 2)
    os.close(fd)
    return stream, path


def fail(exc: BaseException, events: EventLog | None = None) -> None:
    """Report an error the way the log format asks and exit with its code (a bug exits 1)."""
    if not isinstance(exc, BatchspecError):
        logging.getLogger("batchspec").debug("unexpected error", exc_info=exc)
        exc = RuntimeFailure(f"unexpected {type(exc).__name__}: {exc}")
    if getattr(exc, "logged", False):
        sys.exit(exc.exit_code)  # the run already logged it, before its one-line summary
    kind = exc.kind
    if events is not None and events.fmt == "json":
        events.emit("error", str(exc), level="error", exit_code=exc.exit_code, kind=kind)
    else:
        click.echo(f"batchspec: {kind}: {scrub_text(str(exc))}", err=True)
    sys.exit(exc.exit_code)


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec key (dotted; value parsed as YAML). Repeatable.",
)


def load_job(job: str, overrides) -> object:
    try:
        return load_spec(job, overrides)
    except SpecError as exc:
        fail(exc)
