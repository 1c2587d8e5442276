"""batchspec's numeric settings from the environment (``BATCHSPEC_*``): each read when it is used,
never at import, and all checked when a command starts (:func:`check`), so that a value that is
not a number of the right kind ends the command with exit 2 naming the variable, before any work
(docs/storage.md lists them)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from batchspec.errors import SpecError, quoted


@dataclass(frozen=True)
class Setting:
    """One environment variable holding a number."""

    name: str
    default: float
    #: A whole number (``int``), else any finite number (``float``).
    integer: bool = False
    #: Whether 0 is allowed (a negative number never is).
    zero: bool = False

    @property
    def expected(self) -> str:
        kind = "integer" if self.integer else "number"
        return f"a non-negative {kind}" if self.zero else f"a positive {kind}"

    def value(self, environ: Mapping[str, str] | None = None) -> float:
        """The variable's value, or its default where it is not set; SpecError naming it where
        it is set to anything else than :attr:`expected` (empty, not a number, nan, inf)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None:
            return self.default
        try:
            number = int(raw) if self.integer else float(raw)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (number == 0 and not self.zero):
            raise SpecError(self.name, f"expected {self.expected}, got {quoted(raw)}")
        return number


#: Attempts at one storage operation before it fails (:mod:`batchspec.io.retry`).
STORAGE_ATTEMPTS = Setting("BATCHSPEC_STORAGE_ATTEMPTS", 5, integer=True)
#: Seconds of the first backoff between two attempts (doubling, up to 20 s).
STORAGE_BACKOFF_S = Setting("BATCHSPEC_STORAGE_BACKOFF_S", 0.5, zero=True)
#: Seconds one storage request may wait for an answer.
STORAGE_TIMEOUT_S = Setting("BATCHSPEC_STORAGE_TIMEOUT_S", 30.0)

#: Every setting, as :func:`check` checks them.
SETTINGS = (STORAGE_ATTEMPTS, STORAGE_BACKOFF_S, STORAGE_TIMEOUT_S)


def check(environ: Mapping[str, str] | None = None) -> None:
    """SpecError naming the first setting the environment sets to a value it does not take."""
    for setting in SETTINGS:
        setting.value(environ)
