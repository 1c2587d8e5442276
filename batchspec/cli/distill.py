"""`batchspec distill`: options, the --out lock, then :func:`batchspec.distill.session.distill`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from batchspec.distill.options import DistillOptions
from batchspec.distill.outdir import OutLock
from batchspec.distill.session import check_options, distill, render_table
from batchspec.errors import EXIT_SIGINT, NotInstalled

# --------------------------------------------------------------------------- command line


class _LayerIds(click.ParamType):
    """``I,J,K``: the target's layer ids, as a tuple."""

    name = "I,J,K"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, tuple):
            return value
        try:
            return tuple(int(i) for i in str(value).split(",") if i.strip())
        except ValueError:
            self.fail(f"expected layer ids like 1,2,3, got {value!r}", param, ctx)


def _options_of(cls):
    """``click.option`` for each field of ``cls`` that :func:`batchspec.distill.options.option`
    describes, in field order: its flag, default and help are the field's."""

    def apply(command):
        for f in reversed(dataclasses.fields(cls)):
            cli = f.metadata.get("cli")
            if cli is None:
                continue
            cli = dict(cli)
            flag = cli.pop("flag", None) or "--" + f.name.replace("_", "-")
            kwargs = {"default": f.default, "help": cli.pop("help")}
            if cli.pop("path", False):
                kwargs["type"] = click.Path(file_okay=False)
            if cli.pop("layer_ids", False):
                kwargs["type"] = _LayerIds()
            choices = cli.pop("choices", None)
            if choices is not None:
                kwargs["type"] = click.Choice(list(choices))
            if "type" not in kwargs and "type" not in cli and not cli.get("is_flag") and "/" not in flag:
                kwargs["type"] = type(f.default)
            if f.default is not None and not cli.get("is_flag"):
                kwargs["show_default"] = True
            kwargs.update(cli)
            command = click.option(*flag.split(" "), f.name, **kwargs)(command)
        return command

    return apply


@click.command("distill")
@click.argument("job", type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec key (dotted; value parsed as YAML). Repeatable.",
)
@_options_of(DistillOptions)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print {before, after, out, decision} as one JSON object on stdout.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def distill_command(job, overrides, as_json, verbose, **options):
    """Fine-tune a draft (or train an EAGLE-3 head: --method eagle3) on the target's own outputs
    for JOB's prompts, and measure acceptance before and after on held-out prompts."""
    import os

    from batchspec.cli.common import engine_log_file, fail, load_job, quiet_vllm
    from batchspec.run.job import new_run_id

    quiet_vllm(verbose)
    spec = load_job(job, overrides)
    opts = DistillOptions(
        **{**options, "out": Path(options["out"])}, job_path=job, overrides=tuple(overrides)
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
