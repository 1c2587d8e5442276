"""`batchspec distill`: options, the --out lock, then :func:`batchspec.distill.session.distill`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from batchspec.distill.options import DistillOptions
from batchspec.distill.outdir import OutLock
from batchspec.distill.session import check_options, distill, render_table
from batchspec.errors import EXIT_SIGINT, NotInstalled
from batchspec.spec.methods import DRAFT_MODEL, TRAINABLE

# --------------------------------------------------------------------------- command line


@click.command("distill")
@click.argument("job", type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec key (dotted; value parsed as YAML). Repeatable.",
)
@click.option(
    "--draft",
    type=click.Path(file_okay=False),
    default=None,
    help="The draft to start from (and to compare against); its tokenizer must be the target's.",
)
@click.option(
    "--method",
    type=click.Choice(list(TRAINABLE)),
    default=DRAFT_MODEL.name,
    show_default=True,
    help="What to train: a draft model, or an EAGLE-3 head on the target's hidden states.",
)
@click.option(
    "--head",
    type=click.Path(file_okay=False),
    default=None,
    help="With --method eagle3: the head to continue from (and to compare against); none: a new head.",
)
@click.option(
    "--aux-layers",
    default=None,
    metavar="I,J,K",
    help="With --method eagle3 and no --head: the target's layers whose hidden states the new "
    "head reads (default: 1, the middle one, the last).",
)
@click.option(
    "--max-minutes",
    type=float,
    default=None,
    help="Bound the data and the training to this many minutes (the evaluation then runs to its end).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Directory for the new draft or head (weights, config, batchspec-model.json), "
    "replaced whole when distill ends; .NAME.batchspec-distill/ beside it keeps "
    "the generated data for a restart.",
)
@click.option(
    "--init",
    type=click.Choice(["draft", "target"]),
    default="draft",
    show_default=True,
    help="draft: train --draft further; target: a new draft from the target's own "
    "embeddings, first --layers layers and head.",
)
@click.option(
    "--layers", type=int, default=1, show_default=True, help="Layers of the new draft with --init target."
)
@click.option(
    "--sample",
    type=int,
    default=2000,
    show_default=True,
    help="Prompts drawn from the job's input (seeded), held-out ones included.",
)
@click.option(
    "--holdout",
    "heldout",
    type=int,
    default=200,
    show_default=True,
    help="Prompts of the sample kept for evaluation (at most half of it).",
)
@click.option(
    "--logprobs",
    type=int,
    default=0,
    show_default=True,
    metavar="K",
    help="Keep the target's top-K log-probabilities per token and add a KL term.",
)
@click.option("--steps", type=int, default=300, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the sample, the split and the training."
)
@click.option(
    "--k",
    type=int,
    default=None,
    help="Speculative tokens per step in the evaluation (default: the job's, else 4).",
)
@click.option(
    "--eval-concurrency",
    type=int,
    default=None,
    help="Requests in flight in the evaluation (default: execution.max_in_flight).",
)
@click.option(
    "--eval/--no-eval",
    "evaluate_",
    default=True,
    show_default=True,
    help="Measure acceptance before and after on the held-out prompts.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Install the new draft even where its held-out acceptance does not beat --draft's by "
    "more than the noise (or was not measured: --no-eval).",
)
@click.option(
    "--validation",
    type=int,
    default=None,
    help="Prompts of the sample whose continuations judge the training as it goes, never "
    "trained on (default: a tenth of the rest, 2 to 200; none below 10).",
)
@click.option(
    "--patience",
    type=int,
    default=3,
    show_default=True,
    help="Evaluations of held-out top-1 agreement without a new best before training stops.",
)
@click.option(
    "--chunk-rows",
    type=int,
    default=128,
    show_default=True,
    help="Generated rows per committed chunk: a killed run loses at most this many.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print {before, after, out, decision} as one JSON object on stdout.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def distill_command(
    job,
    overrides,
    draft,
    method,
    head,
    aux_layers,
    max_minutes,
    out,
    init,
    layers,
    sample,
    heldout,
    logprobs,
    steps,
    lr,
    batch_size,
    seed,
    k,
    eval_concurrency,
    evaluate_,
    force,
    validation,
    patience,
    chunk_rows,
    as_json,
    verbose,
):
    """Fine-tune a draft (or train an EAGLE-3 head: --method eagle3) on the target's own outputs
    for JOB's prompts, and measure acceptance before and after on held-out prompts."""
    import os

    from batchspec.cli.common import engine_log_file, fail, load_job, quiet_vllm
    from batchspec.run.job import new_run_id

    quiet_vllm(verbose)
    spec = load_job(job, overrides)
    try:
        aux = None if aux_layers is None else tuple(int(i) for i in aux_layers.split(",") if i.strip())
    except ValueError:
        fail_usage = f"--aux-layers: expected layer ids like 1,2,3, got {aux_layers!r}"
        raise click.BadParameter(fail_usage, param_hint="--aux-layers") from None
    opts = DistillOptions(
        out=Path(out),
        draft=draft,
        method=method,
        head=head,
        aux_layers=aux,
        max_minutes=max_minutes,
        init=init,
        layers=layers,
        sample=sample,
        heldout=heldout,
        logprobs=logprobs,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        k=k,
        eval_concurrency=eval_concurrency,
        evaluate=evaluate_,
        force=force,
        validation=validation,
        patience=patience,
        chunk_rows=chunk_rows,
        job_path=job,
        overrides=tuple(overrides),
    )
    try:
        # before the log redirection: refusals reach the terminal as is, before any engine
        check_options(spec, opts)
        lock = OutLock.take(opts.out)
    except Exception as exc:
        fail(exc)
    # stdout carries the result only: vLLM's processes and torch write to the engine log
    stdout = os.fdopen(os.dup(1), "w", buffering=1)
    stream = sys.stderr
    if not verbose:
        stream, engine_log = engine_log_file(new_run_id())
        print(f"batchspec distill: vLLM's own output goes to {engine_log} (-v shows it here)", file=stream)

    def progress(msg: str) -> None:
        print(f"batchspec distill: {msg}", file=stream, flush=True)

    refused = None
    try:
        result = distill(spec, opts, progress, lock=lock)
    except KeyboardInterrupt:
        print("batchspec: interrupted", file=stream)
        sys.exit(EXIT_SIGINT)
    except NotInstalled as exc:  # measured and not better: the figures still go to stdout
        refused, result = exc, exc.result
    except Exception as exc:
        sys.stderr = stream  # fail reports on stderr: the terminal's, not the engine log
        fail(exc)
    finally:
        lock.release()
    if as_json:
        stdout.write(json.dumps(result.as_json()) + "\n")
    else:
        stdout.write(render_table(result))
    stdout.flush()
    if refused is not None:
        sys.stderr = stream
        fail(refused)
