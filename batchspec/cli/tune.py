"""`batchspec tune`: options, the files it writes checked before measuring, then
:func:`batchspec.tune.session.run_tune`."""

from __future__ import annotations

import os
import sys

import click

from batchspec.cli.common import engine_log_file, load_job, quiet_vllm
from batchspec.errors import EXIT_SIGINT, BatchspecError, RuntimeFailure
from batchspec.redact import scrub_text
from batchspec.tune.model import DEFAULT_K, OBJECTIVES, TuneOptions, TuneReport
from batchspec.tune.render import render_table
from batchspec.tune.session import tune_secrets
from batchspec.tune.written import (
    check_output_files,
    check_writable,
    spec_as_written,
    write_output,
    written_spec,
)

# --------------------------------------------------------------------------- command line

#: The options' defaults, as the library declares them.
_DEFAULTS = TuneOptions()


def _int_list(value: str | None, what: str) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}", param_hint=what
        ) from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}", param_hint=what)
    return out


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec key (dotted; value parsed as YAML). Repeatable.",
)
@click.option(
    "--sample",
    type=int,
    default=_DEFAULTS.sample,
    show_default=True,
    help="Rows drawn (seeded, uniformly) from the job's input.",
)
@click.option("--seed", type=int, default=_DEFAULTS.seed, show_default=True, help="Seed of the sample.")
@click.option(
    "--concurrency",
    "concurrency",
    metavar="1,16,64",
    help="Requests in flight to measure at (default: the job's model.engine.max_num_seqs, "
    "else execution.max_in_flight).",
)
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    metavar="PATH",
    help="Another draft model to try (draft_model method). Repeatable.",
)
@click.option(
    "--k",
    "ks",
    metavar="1,2,...",
    help="num_speculative_tokens to consider for each "
    f"draft (default {','.join(map(str, DEFAULT_K))}); the largest is measured, the rest "
    "predicted.",
)
@click.option(
    "--top",
    type=int,
    default=_DEFAULTS.top,
    show_default=True,
    help="Per draft and concurrency, measure the best this many predicted k.",
)
@click.option(
    "--repeats",
    type=int,
    default=_DEFAULTS.repeats,
    show_default=True,
    help="Times speculation off is measured per concurrency: its spread is the noise.",
)
@click.option(
    "--objective",
    type=click.Choice(OBJECTIVES),
    default=_DEFAULTS.objective,
    show_default=True,
    help="throughput: output tok/s; latency: e2e p50.",
)
@click.option(
    "--ngram/--no-ngram",
    default=_DEFAULTS.ngram,
    show_default=True,
    help="Try n-gram (prompt lookup) speculation with k 2 and 4.",
)
@click.option(
    "--batch-knobs/--no-batch-knobs",
    default=_DEFAULTS.batch_knobs,
    show_default=True,
    help="After the drafters, measure max_num_seqs (with max_in_flight) and "
    "max_num_batched_tokens for the recommendation, in up to 3 more engines; "
    "recommended (and written by --write) only where they beat the noise.",
)
@click.option(
    "--max-minutes",
    type=float,
    default=_DEFAULTS.max_minutes,
    help="Bound the whole tune; what was not measured in time is listed as skipped.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="Also write a self-contained HTML page with a tok/s chart to this file.",
)
@click.option(
    "--write",
    "write_file",
    type=click.Path(dir_okay=False),
    help="Write the job with the recommended speculative section to this file.",
)
@click.option(
    "--progress/--no-progress", default=None, help="Progress bar (default: only when stderr is a terminal)."
)
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def tune(
    job,
    overrides,
    sample,
    seed,
    concurrency,
    drafts,
    ks,
    top,
    repeats,
    objective,
    ngram,
    batch_knobs,
    max_minutes,
    as_json,
    html_file,
    write_file,
    progress,
    verbose,
):
    """Measure speculation off and candidate drafts/k on a sample of JOB's own prompts, and
    recommend per concurrency (exit 0; 1 when a candidate's greedy text differs from off's)."""
    from batchspec.tune import session

    quiet_vllm(verbose)
    options = TuneOptions(
        sample=sample,
        seed=seed,
        concurrency=_int_list(concurrency, "--concurrency"),
        drafts=list(drafts),
        ks=_int_list(ks, "--k") or list(DEFAULT_K),
        repeats=repeats,
        objective=objective,
        top=top,
        max_minutes=max_minutes,
        ngram=ngram,
        batch_knobs=batch_knobs,
    )
    spec = load_job(job, overrides)
    secrets = tune_secrets(spec, drafts)
    try:  # everything tune will write is checked before any engine starts: a bad one exits 2
        check_output_files(job, spec, {"--html": html_file, "--write": write_file})
        if write_file:
            check_writable(spec_as_written(job, overrides), drafts)
    except BatchspecError as exc:
        _fail_to(sys.stderr, exc, secrets)
    out, stream = _streams(verbose)
    bar = progress if progress is not None else _isatty(stream)
    try:
        report = session.run_tune(spec, options, job=job, stream=stream, progress_bar=bar)
        page = None
        if html_file:
            from batchspec.tune.html import render_tune_html

            page = render_tune_html(report.as_dict())
        text = (
            written_spec(job, overrides, report, spec.model.engine.get("max_num_seqs"))
            if write_file
            else None
        )
    except KeyboardInterrupt:
        print("batchspec: interrupted", file=stream)
        sys.exit(EXIT_SIGINT)
    except BatchspecError as exc:
        _fail_to(stream, exc, secrets)
    except Exception as exc:
        _fail_to(stream, RuntimeFailure(f"unexpected {type(exc).__name__}: {exc}"), secrets)
    _print_report(out, report, as_json)
    _write_files(stream, job, (("--html", html_file, page), ("--write", write_file, text)), secrets)
    _exit_if_not_lossless(stream, report)


def _streams(verbose: bool) -> tuple[object, object]:
    """(where the table or JSON goes, batchspec's own stream). Unless --verbose, vLLM's own
    output goes to a log file and the report keeps the real stdout."""
    if verbose:
        return sys.stdout, sys.stderr
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    stream, engine_log = engine_log_file("tune")
    print(
        f"batchspec tune: vLLM's own output goes to {engine_log} (-v shows it here)", file=stream, flush=True
    )
    return out, stream


def _print_report(out, report: TuneReport, as_json: bool) -> None:
    if as_json:
        import json

        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(render_table(report))
    out.flush()


def _write_files(stream, job: str, files, secrets: set[str]) -> None:
    """``(option, path, content)``: each file with content written (exit 1 naming the option
    where it cannot be)."""
    for option, path, content in files:
        if content is None:
            continue
        try:
            write_output(path, content, like=job)
        except OSError as exc:
            _fail_to(
                stream, RuntimeFailure(f"{option}: cannot write {path!r}: {exc.strerror or exc}"), secrets
            )
        print(f"batchspec tune: wrote {path}", file=stream)


def _exit_if_not_lossless(stream, report: TuneReport) -> None:
    """Exit 1, naming each row, where a candidate's greedy text differs from speculation off's."""
    if not report.mismatches:
        return
    for m in report.mismatches:
        print(
            f"batchspec tune: NOT LOSSLESS: row {m['row']}: {m['candidate']} at concurrency "
            f"{m['concurrency']} differs from speculation off at character "
            f"{m['first_difference_at_char']}: off {m['off']!r} vs {m['candidate_text']!r}",
            file=stream,
        )
    sys.exit(1)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fail_to(stream, exc: BatchspecError, secrets: set[str] | frozenset[str] = frozenset()) -> None:
    print(f"batchspec: {exc.kind}: {scrub_text(str(exc), secrets)}", file=stream, flush=True)
    sys.exit(exc.exit_code)
