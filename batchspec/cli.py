"""Command line: click commands over the library API, nothing else.

Exit codes (docs/contract.md): 0 done, 1 runtime failure, 2 bad spec or command line, 3 bad input.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from batchspec import __version__
from batchspec.errors import BatchspecError, RuntimeFailure, SpecError
from batchspec.events import LOG_FORMATS, EventLog
from batchspec.redact import sanitize_url, scrub_text
from batchspec.spec import load_spec


def _quiet_vllm(verbose: bool, log_format: str = "text") -> None:
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


def _engine_log(run_id: str) -> tuple[object, str]:
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


def _fail(exc: BaseException, events: EventLog | None = None) -> None:
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchspec")
def main() -> None:
    """batchspec: offline batch LLM inference over Parquet shards, with vLLM speculative decoding
    and per-request acceptance and timing columns."""


_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="Override a spec key (dotted; value parsed as YAML). Repeatable.")


def _load(job: str, overrides) -> object:
    try:
        return load_spec(job, overrides)
    except SpecError as exc:
        _fail(exc)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_set_option
@click.option("--worker-index", type=int, default=0, show_default=True,
              envvar=["BATCHSPEC_WORKER_INDEX", "JOB_COMPLETION_INDEX"],
              help="This worker's index, 0-based (Airflow map index, Kubernetes job index); "
                   "default from $BATCHSPEC_WORKER_INDEX, else a Kubernetes Indexed Job's "
                   "$JOB_COMPLETION_INDEX.")
@click.option("--num-workers", type=int, default=1, show_default=True,
              envvar="BATCHSPEC_NUM_WORKERS",
              help="How many workers share the job's shards (default from $BATCHSPEC_NUM_WORKERS).")
@click.option("--overwrite", is_flag=True, help="Redo every shard, committed or not.")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
              help="text for people, json for one object per line.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bars (default: only when stderr is a terminal).")
@click.option("--progress-interval", type=float, default=None, metavar="SECONDS",
              help="Seconds between progress log lines when there are no bars "
                   "(default: execution.progress_interval_s, 30).")
@click.option("--grace-seconds", type=float, default=None, metavar="SECONDS",
              help="After SIGTERM/SIGINT, let requests of fully read shards finish for this long "
                   "before aborting the rest (default: execution.grace_s, 30).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
              help="Where the shards run: local (one engine in this process) or ray (Ray "
                   "replicas, one engine each); default: the spec's executor.kind, else local.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="With --executor ray: the Ray cluster to join (default: executor.ray_address; "
                   "none starts a local cluster).")
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def run(job, overrides, worker_index, num_workers, overwrite, log_format, progress,
        progress_interval, grace_seconds, executor, ray_address, verbose):
    """Run JOB: every pending input shard becomes one committed output shard."""
    _quiet_vllm(verbose, log_format)
    if progress_interval is not None:
        overrides = (*overrides, f"execution.progress_interval_s={progress_interval}")
    if grace_seconds is not None:
        overrides = (*overrides, f"execution.grace_s={grace_seconds}")
    spec = _load(job, overrides)
    if ray_address and (executor or spec.executor.kind) != "ray":
        _fail(SpecError("--ray-address", "needs --executor ray (or executor.kind: ray)"))
    from batchspec.runner import new_run_id, run_job

    run_id = new_run_id()
    stream = None
    if not verbose:
        stream, engine_log = _engine_log(run_id)
    events = EventLog(run_id, log_format, stream)
    if stream is not None:
        events.engine_log = engine_log
        events.emit("engine_log", f"vLLM's own output goes to {engine_log} (-v shows it here)",
                    path=engine_log)
    try:
        run_job(spec, worker_index=worker_index, num_workers=num_workers, overwrite=overwrite,
                events=events, progress_bars=progress, run_id=run_id, executor=executor,
                ray_address=ray_address)
    except KeyboardInterrupt:
        click.echo("batchspec: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        _fail(exc, events)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_set_option
@click.option("--worker-index", type=int, default=0, show_default=True)
@click.option("--num-workers", type=int, default=1, show_default=True)
def validate(job, overrides, worker_index, num_workers):
    """Check JOB without loading model weights: spec keys (against vLLM's own config classes),
    shards, columns and prompt lengths."""
    _quiet_vllm(False)
    spec = _load(job, overrides)
    from batchspec.validate import validate_job

    try:
        report = validate_job(spec, worker_index=worker_index, num_workers=num_workers)
    except Exception as exc:
        _fail(exc)
    click.echo(report.render())
    if report.exit_code:
        sys.exit(report.exit_code)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_set_option
@click.option("--worker-index", type=int, default=0, show_default=True)
@click.option("--num-workers", type=int, default=1, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
def status(job, overrides, worker_index, num_workers, fmt):
    """Which of JOB's shards are committed, stale, partial or pending, and which outputs have no
    current input (orphans: never counted as done)."""
    spec = _load(job, overrides)
    from batchspec.runner import plan

    try:
        p = plan(spec, worker_index, num_workers)
    except Exception as exc:
        _fail(exc)
    rows = [{"shard": s.name, "state": p.states[s.name], "input": sanitize_url(s.url),
             "output": sanitize_url(p.out.output_path(s)) if p.states[s.name] == "committed"
             else None, "changed": p.stale.get(s.name, [])}
            for s in p.shards]
    if fmt == "json":  # one object a shard, then one a orphan output (state "orphan")
        orphans = [{"shard": n, "state": "orphan", "input": None, "output": n, "changed": []}
                   for n in p.orphans]
        click.echo(json.dumps(rows + orphans, indent=2))
        return
    width = max([len(r["shard"]) for r in rows] + [5])
    for r in rows:
        changed = f"  (changed: {', '.join(r['changed'])})" if r["changed"] else ""
        click.echo(f"{r['shard']:<{width}}  {r['state']:<9}  {r['input']}{changed}")
    for name in p.orphans:
        click.echo(f"{name:<{width}}  {'orphan':<9}  (output with no current input)")
    counts = _state_counts(rows)
    click.echo(f"{len(rows)} shards: " + ", ".join(f"{v} {k}" for k, v in counts.items())
               + (f"; {len(p.orphans)} orphan outputs" if p.orphans else ""))


def _state_counts(rows: list[dict]) -> dict[str, int]:
    return {k: sum(1 for r in rows if r["state"] == k)
            for k in ("committed", "partial", "pending", "stale")}


@main.command()
@click.argument("output_path", required=False)
@click.argument("output_path_b", required=False)
@click.option("--job", "job", type=click.Path(dir_okay=False), metavar="JOB.yaml",
              help="Report on this job's output.path, read with its output.storage_options; "
                   "an OUTPUT_PATH given too is then compared (as B) against it.")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option for reading the output (dotted keys nest: "
                   "client_kwargs.endpoint_url=URL; value parsed as YAML); over --job's. Repeatable.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown"]), default="table",
              show_default=True, help="table for a terminal, json for machines, markdown for PRs.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="Also write a self-contained HTML page with charts to this file.")
def report(output_path, output_path_b, job, storage_options, fmt, html_file):
    """Acceptance and timing statistics of the finished run at OUTPUT_PATH (its output.path).

    With OUTPUT_PATH_B, compare two runs side by side (B against A) and match their rows by
    request_id. Both are read with the same storage options."""
    from batchspec.report import compare, load_output, parse_storage_options, render, summarize

    paths = [p for p in (output_path, output_path_b) if p]
    base: dict = {}
    if job:
        if len(paths) > 1:
            raise click.UsageError("with --job give at most one OUTPUT_PATH (compared against "
                                   "the job's output)")
        spec = _load(job, ())
        paths.insert(0, spec.output.path)
        base = spec.output.storage_options
    elif not paths:
        raise click.UsageError("give OUTPUT_PATH, or --job JOB.yaml")
    try:
        options = parse_storage_options(storage_options, base)
        outputs = [load_output(p, options) for p in paths]
        # statistics read the files lazily: unreadable rows surface here, not in load_output
        result = compare(*outputs) if len(outputs) == 2 else summarize(outputs[0])
        page = None
        if html_file:
            from batchspec.html_report import render_html

            page = render_html(result, outputs)
    except BatchspecError as exc:
        _fail(exc)
    click.echo(render(result, fmt), nl=False)
    if page is not None:
        with open(html_file, "w", encoding="utf-8") as f:
            f.write(page)
        click.echo(f"batchspec: wrote {html_file}", err=True)  # stderr: stdout stays parseable


from batchspec.tune import tune as _tune  # noqa: E402  (its own module; registered here)

main.add_command(_tune)

from batchspec.distill import distill_command as _distill  # noqa: E402  (its own module)

main.add_command(_distill)


if __name__ == "__main__":
    main()
