"""Errors that end a job, each with the exit code the contract gives it, and the exit codes
themselves: :data:`EXIT_CODES` is the one place they are written (the README's table is checked
against it by tests/docs)."""

from __future__ import annotations

import reprlib
import signal
from dataclasses import dataclass
from typing import Any

# ---------------------------------------------------------------------------- exit codes

EXIT_OK = 0
EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_SPEC = 2
EXIT_BAD_INPUT = 3
EXIT_NOT_INSTALLED = 4
#: A shell reports a process that a signal stopped as 128 + the signal's number.
EXIT_SIGNALLED = 128
EXIT_SIGINT = EXIT_SIGNALLED + signal.SIGINT.value
EXIT_SIGTERM = EXIT_SIGNALLED + signal.SIGTERM.value


@dataclass(frozen=True)
class ExitCode:
    """One row of the contract's exit codes."""

    #: The codes the row covers (two for the signals).
    codes: tuple[int, ...]
    #: An error's :attr:`BatchspecError.kind`: what the code means in a few words (None: success).
    kind: str | None
    #: What it means to a scheduler, as the README's table says it (Markdown).
    meaning: str


#: Every exit code batchspec's commands end with.
EXIT_CODES = (
    ExitCode(
        (EXIT_OK,),
        None,
        "every assigned shard is committed (rows with a per-row `error` still count as done)",
    ),
    ExitCode(
        (EXIT_RUNTIME_FAILURE,),
        "runtime failure",
        "runtime failure: engine died past its restarts, storage failed after retries, shards held by "
        "another live run, a Ray shard failed on every try, `distill --out` held by another distill",
    ),
    ExitCode(
        (EXIT_BAD_SPEC,),
        "bad job spec",
        "bad job spec or command line; the message names the key or option",
    ),
    ExitCode(
        (EXIT_BAD_INPUT,),
        "bad input data",
        "bad input data (unreadable shard, missing or mistyped column); the message names the shard "
        "and the column",
    ),
    ExitCode(
        (EXIT_NOT_INSTALLED,),
        "not installed",
        "`distill`: the new drafter did not beat `--draft` (`--head`) on held-out prompts by more than "
        "the noise; nothing installed (`--force` installs anyway)",
    ),
    ExitCode(
        (EXIT_SIGINT, EXIT_SIGTERM),
        "interrupted",
        "stopped by SIGINT / SIGTERM: nothing partial committed, engine shut down, summary written",
    ),
)

_KINDS = {code: row.kind for row in EXIT_CODES for code in row.codes if row.kind is not None}


def exit_codes_markdown() -> str:
    """:data:`EXIT_CODES` as the README's Markdown table."""
    lines = ["| code | meaning |", "| --- | --- |"]
    lines += [f"| {' / '.join(map(str, row.codes))} | {row.meaning} |" for row in EXIT_CODES]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- errors

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def quoted(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut short without building it whole (a
    row's value may be megabytes)."""
    return _REPR.repr(value)


class BatchspecError(Exception):
    """Base class: a failure that ends the job with ``exit_code``."""

    exit_code = EXIT_RUNTIME_FAILURE

    @property
    def kind(self) -> str:
        """What the exit code means, in words (docs/contract.md)."""
        # any other code is 128 + the number of the signal that stopped the job
        return _KINDS.get(self.exit_code, "interrupted")


class RuntimeFailure(BatchspecError):
    """The engine died (past ``execution.engine_restarts``) or storage failed after retries (exit 1)."""

    exit_code = EXIT_RUNTIME_FAILURE


class Interrupted(BatchspecError):
    """SIGTERM or SIGINT stopped the job; nothing partial was committed (exit 128 + signal:
    130 for SIGINT, 143 for SIGTERM, as shells report it)."""

    def __init__(self, message: str, signum: int = 15):
        self.exit_code = EXIT_SIGNALLED + signum
        super().__init__(message)


def interrupted_within(exc: BaseException | None) -> Interrupted | None:
    """The :class:`Interrupted` a signal raised, where ``exc`` is it or was raised from it
    (vLLM's start-up and batchspec's own wrappers wrap what interrupts them): None for any
    other failure. A stop is never taken for an engine that failed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Interrupted):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class SpecError(BatchspecError):
    """A bad job spec or command line (exit 2). ``key`` is the dotted spec key at fault."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, key: str | None, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class InputDataError(BatchspecError):
    """Unreadable input or a missing/mistyped column (exit 3); names the shard and column."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, shard: str, message: str, column: str | None = None):
        self.shard = shard
        self.column = column
        super().__init__(f"{shard}: {message}")


class NotInstalled(BatchspecError):
    """``distill`` trained a drafter that did not beat the starting one on the held-out prompts
    by more than the noise (exit 4): the starting drafter stays, ``--out`` is left as it was.
    ``result`` holds the evaluation (before, after, the decision)."""

    exit_code = EXIT_NOT_INSTALLED

    def __init__(self, message: str, result=None):
        self.result = result
        super().__init__(message)
