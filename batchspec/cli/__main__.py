"""`python -m batchspec.cli`: the same as the `batchspec` command."""

from batchspec.cli import main

main()
