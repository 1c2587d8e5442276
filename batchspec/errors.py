"""Errors that end a job, each with the exit code the contract gives it."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def quoted(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut short without building it whole (a
    row's value may be megabytes)."""
    return _REPR.repr(value)


class BatchspecError(Exception):
    """Base class: a failure that ends the job with ``exit_code``."""

    exit_code = 1

    @property
    def kind(self) -> str:
        """What the exit code means, in words (docs/contract.md)."""
        return {
            1: "runtime failure",
            2: "bad job spec",
            3: "bad input data",
            4: "not installed",
        }.get(self.exit_code, "interrupted")


class RuntimeFailure(BatchspecError):
    """The engine died or storage failed after retries (exit 1)."""

    exit_code = 1


class Interrupted(BatchspecError):
    """SIGTERM or SIGINT stopped the job; nothing partial was committed (exit 128 + signal:
    130 for SIGINT, 143 for SIGTERM, as shells report it)."""

    def __init__(self, message: str, signum: int = 15):
        self.exit_code = 128 + signum
        super().__init__(message)


class SpecError(BatchspecError):
    """A bad job spec or command line (exit 2). ``key`` is the dotted spec key at fault."""

    exit_code = 2

    def __init__(self, key: str | None, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class InputDataError(BatchspecError):
    """Unreadable input or a missing/mistyped column (exit 3); names the shard and column."""

    exit_code = 3

    def __init__(self, shard: str, message: str, column: str | None = None):
        self.shard = shard
        self.column = column
        super().__init__(f"{shard}: {message}")


class NotInstalled(BatchspecError):
    """``distill`` trained a drafter that did not beat the starting one on the held-out prompts
    by more than the noise (exit 4): the starting drafter stays, ``--out`` is left as it was.
    ``result`` holds the evaluation (before, after, the decision)."""

    exit_code = 4

    def __init__(self, message: str, result=None):
        self.result = result
        super().__init__(message)
