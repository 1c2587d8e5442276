"""The job commands: run, validate, status, report; each parses its options and calls one
library function."""

from __future__ import annotations

import json
import sys

import click

from batchspec.cli.common import engine_log_file, fail, load_job, quiet_vllm, set_option
from batchspec.errors import EXIT_SIGINT, BatchspecError, SpecError
from batchspec.run.events import LOG_FORMATS, EventLog


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
@click.option(
    "--worker-index",
    type=int,
    default=0,
    show_default=True,
    envvar=["BATCHSPEC_WORKER_INDEX", "JOB_COMPLETION_INDEX"],
    help="This worker's index, 0-based (Airflow map index, Kubernetes job index); "
    "default from $BATCHSPEC_WORKER_INDEX, else a Kubernetes Indexed Job's "
    "$JOB_COMPLETION_INDEX.",
)
@click.option(
    "--num-workers",
    type=int,
    default=1,
    show_default=True,
    envvar="BATCHSPEC_NUM_WORKERS",
    help="How many workers share the job's shards (default from $BATCHSPEC_NUM_WORKERS).",
)
@click.option("--overwrite", is_flag=True, help="Redo every shard, committed or not.")
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="text for people, json for one object per line.",
)
@click.option(
    "--progress/--no-progress", default=None, help="Progress bars (default: only when stderr is a terminal)."
)
@click.option(
    "--progress-interval",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Seconds between progress log lines when there are no bars "
    "(default: execution.progress_interval_s, 30).",
)
@click.option(
    "--grace-seconds",
    type=float,
    default=None,
    metavar="SECONDS",
    help="After SIGTERM/SIGINT, let requests of fully read shards finish for this long "
    "before aborting the rest (default: execution.grace_s, 30).",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Where the shards run: local (one engine in this process) or ray (Ray "
    "replicas, one engine each); default: the spec's executor.kind, else local.",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDR",
    help="With --executor ray: the Ray cluster to join (default: executor.ray_address; "
    "none starts a local cluster).",
)
@click.option(
    "--remeasure",
    is_flag=True,
    help="With speculative: auto, measure the candidates again even where a choice "
    "stored for this job, model, draft, sampling and machine exists.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def run(
    job,
    overrides,
    worker_index,
    num_workers,
    overwrite,
    log_format,
    progress,
    progress_interval,
    grace_seconds,
    executor,
    ray_address,
    remeasure,
    verbose,
):
    """Run JOB: every pending input shard becomes one committed output shard."""
    quiet_vllm(verbose, log_format)
    if progress_interval is not None:
        overrides = (*overrides, f"execution.progress_interval_s={progress_interval}")
    if grace_seconds is not None:
        overrides = (*overrides, f"execution.grace_s={grace_seconds}")
    spec = load_job(job, overrides)
    if remeasure and spec.speculative_auto is None:
        fail(
            SpecError(
                "--remeasure", "only speculative: auto measures; this job's speculative section is fixed"
            )
        )
    if ray_address and (executor or spec.executor.kind) != "ray":
        fail(SpecError("--ray-address", "needs --executor ray (or executor.kind: ray)"))
    from batchspec.run.job import RunOptions, new_run_id, run_job

    run_id = new_run_id()
    stream = None
    if not verbose:
        stream, engine_log = engine_log_file(run_id)
    events = EventLog(run_id, log_format, stream)
    if stream is not None:
        events.engine_log = engine_log
        events.emit(
            "engine_log", f"vLLM's own output goes to {engine_log} (-v shows it here)", path=engine_log
        )
    try:
        run_job(
            spec,
            RunOptions(
                worker_index=worker_index,
                num_workers=num_workers,
                overwrite=overwrite,
                events=events,
                progress_bars=progress,
                run_id=run_id,
                executor=executor,
                ray_address=ray_address,
                remeasure=remeasure,
            ),
        )
    except KeyboardInterrupt:
        click.echo("batchspec: interrupted", err=True)
        sys.exit(EXIT_SIGINT)
    except Exception as exc:
        fail(exc, events)


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
@click.option("--worker-index", type=int, default=0, show_default=True)
@click.option("--num-workers", type=int, default=1, show_default=True)
def validate(job, overrides, worker_index, num_workers):
    """Check JOB without loading model weights: spec keys (against vLLM's own config classes),
    shards, columns and prompt lengths."""
    quiet_vllm(False)
    spec = load_job(job, overrides)
    from batchspec.run.validate import validate_job

    try:
        report = validate_job(spec, worker_index=worker_index, num_workers=num_workers)
    except Exception as exc:
        fail(exc)
    click.echo(report.render())
    if report.exit_code:
        sys.exit(report.exit_code)


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
@click.option("--worker-index", type=int, default=0, show_default=True)
@click.option("--num-workers", type=int, default=1, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(job, overrides, worker_index, num_workers, fmt):
    """Which of JOB's shards are committed, stale, partial or pending, and which outputs have no
    current input (orphans: never counted as done)."""
    spec = load_job(job, overrides)
    from batchspec.run.status import job_status, state_counts

    try:
        status_ = job_status(spec, worker_index, num_workers)
    except Exception as exc:
        fail(exc)
    rows, orphan_names = status_["shards"], status_["orphans"]
    if fmt == "json":  # one object a shard, then one a orphan output (state "orphan")
        orphans = [
            {"shard": n, "state": "orphan", "input": None, "output": n, "changed": []} for n in orphan_names
        ]
        click.echo(json.dumps(rows + orphans, indent=2))
        return
    width = max([len(r["shard"]) for r in rows] + [5])
    for r in rows:
        changed = f"  (changed: {', '.join(r['changed'])})" if r["changed"] else ""
        click.echo(f"{r['shard']:<{width}}  {r['state']:<9}  {r['input']}{changed}")
    for name in orphan_names:
        click.echo(f"{name:<{width}}  {'orphan':<9}  (output with no current input)")
    pin, table = status_.get("input_pin"), status_.get("table")
    if pin is not None:
        key = "version" if "version" in pin else "snapshot"
        click.echo(f"input: {pin['format']} table {pin.get('table')} at {key} {pin.get(key)}")
    if table is not None:
        where = f"version {table['version']}" if table["exists"] else "not created yet"
        click.echo(f"output: {table['format']} table, {where}")
    counts = state_counts(rows)
    click.echo(
        f"{len(rows)} shards: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + (f"; {len(orphan_names)} orphan outputs" if orphan_names else "")
    )


@click.command()
@click.argument("output_path", required=False)
@click.argument("output_path_b", required=False)
@click.option(
    "--job",
    "job",
    type=click.Path(dir_okay=False),
    metavar="JOB.yaml",
    help="Report on this job's output.path, read with its output.storage_options; "
    "an OUTPUT_PATH given too is then compared (as B) against it.",
)
@click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option for reading the output (dotted keys nest: "
    "client_kwargs.endpoint_url=URL; value parsed as YAML); over --job's. Repeatable.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "markdown"]),
    default="table",
    show_default=True,
    help="table for a terminal, json for machines, markdown for PRs.",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="Also write a self-contained HTML page with charts to this file.",
)
def report(output_path, output_path_b, job, storage_options, fmt, html_file):
    """Acceptance and timing statistics of the finished run at OUTPUT_PATH (its output.path).

    With OUTPUT_PATH_B, compare two runs side by side (B against A) and match their rows by
    request_id. Both are read with the same storage options."""
    from batchspec.report.comparison import compare
    from batchspec.report.metrics import summarize
    from batchspec.report.read import load_output, parse_storage_options
    from batchspec.report.text import render

    paths = [p for p in (output_path, output_path_b) if p]
    base: dict = {}
    table_output = None
    if job:
        if len(paths) > 1:
            raise click.UsageError(
                "with --job give at most one OUTPUT_PATH (compared against the job's output)"
            )
        spec = load_job(job, ())
        paths.insert(0, spec.output.path)
        base = spec.output.storage_options
        table_output = spec.output  # an Iceberg table is found through its catalog
    elif not paths:
        raise click.UsageError("give OUTPUT_PATH, or --job JOB.yaml")
    try:
        options = parse_storage_options(storage_options, base)
        outputs = [load_output(p, options, table_output) for p in paths]
        # statistics read the files lazily: unreadable rows surface here, not in load_output
        result = compare(*outputs) if len(outputs) == 2 else summarize(outputs[0])
        page = None
        if html_file:
            from batchspec.report.html import render_html

            page = render_html(result, outputs)
    except BatchspecError as exc:
        fail(exc)
    click.echo(render(result, fmt), nl=False)
    if page is not None:
        with open(html_file, "w", encoding="utf-8") as f:
            f.write(page)
        click.echo(f"batchspec: wrote {html_file}", err=True)  # stderr: stdout stays parseable
