"""The command line: every click command and nothing else. Each command parses its options and
calls the library (batchspec/run, tune, distill, report); nothing
outside this package imports click or this package."""

from __future__ import annotations

import click

from batchspec import __version__, settings
from batchspec.cli.common import fail
from batchspec.cli.distill import distill_command
from batchspec.cli.jobs import report, run, status, validate
from batchspec.cli.tune import tune
from batchspec.errors import SpecError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchspec")
def main() -> None:
    """batchspec: offline batch LLM inference over Parquet shards, with vLLM speculative decoding
    and per-request acceptance and timing columns."""
    try:
        settings.check()  # the BATCHSPEC_* numbers, before any command does any work
    except SpecError as exc:
        fail(exc)


for command in (run, validate, status, report, tune, distill_command):
    main.add_command(command)
