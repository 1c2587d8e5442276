"""Structured run events and live progress.

Events (``run_started``, ``shard_started``, ``shard_committed``, ``shard_failed``,
``shard_skipped``, ``progress``, ``run_finished``, ...) go to stderr, as text for people or as
one JSON object per line for schedulers (``--log-format json``). Progress is a pair of tqdm bars
at a terminal and a ``progress`` event every few seconds elsewhere (cron, Airflow)."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from typing import Any, TextIO

from batchspec.redact import scrub_text
from batchspec.stats import acceptance_rate, mean_acceptance_length, tokens_per_s

LOG_FORMATS = ("text", "json")


class EventLog:
    """Writes run events to a stream as text or JSON lines."""

    def __init__(self, run_id: str, fmt: str = "text", stream: TextIO | None = None):
        if fmt not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
        self.run_id = run_id
        self.fmt = fmt
        self.stream = stream if stream is not None else sys.stderr
        self._bar_writer = None  # set by Progress so that lines do not break the bars
        self._secrets: set[str] = set()
        #: Where vLLM's own output goes (set by the CLI), named in engine errors.
        self.engine_log: str | None = None

    def add_secrets(self, values) -> None:
        """Values never to print (credentials from the spec); URLs are always sanitised."""
        self._secrets.update(v for v in values if isinstance(v, str))

    def scrub(self, text: str) -> str:
        """``text`` with secrets masked and URLs stripped of userinfo and query strings."""
        return scrub_text(text, self._secrets)

    def emit(self, event: str, message: str = "", level: str = "info", **fields: Any) -> None:
        """Log one event with its fields."""
        now = dt.datetime.now(dt.UTC)
        message = self.scrub(message)
        fields = {k: self.scrub(v) if isinstance(v, str) else v for k, v in fields.items()}
        if self.fmt == "json":
            record = {
                "ts": now.isoformat(timespec="milliseconds"),
                "level": level,
                "event": event,
                "run_id": self.run_id,
                **fields,
            }
            if message:
                record["message"] = message
            line = json.dumps(record, default=str, sort_keys=False)
        else:
            details = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
            text = message or event.replace("_", " ")
            line = f"{now.strftime('%H:%M:%S')} [batchspec] {text}" + (f" ({details})" if details else "")
        if self._bar_writer is not None:
            self._bar_writer(line)
        else:
            print(line, file=self.stream, flush=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """Live progress over rows and shards: tqdm bars at a terminal, periodic events otherwise."""

    def __init__(
        self, events: EventLog, total_rows: int, total_shards: int, bars: bool, interval_s: float = 30.0
    ):
        self.events = events
        self.total_rows = total_rows
        self.total_shards = total_shards
        self.interval_s = interval_s
        self.rows = 0
        self.shards = 0
        self.output_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.spec_steps = 0
        self.errors = 0
        self.started = time.monotonic()
        self._last_log = self.started
        self._shard_bar = self._row_bar = None
        if bars:
            from tqdm.auto import tqdm

            self._shard_bar = tqdm(
                total=total_shards,
                unit="shard",
                desc="shards",
                position=0,
                file=events.stream,
                dynamic_ncols=True,
            )
            self._row_bar = tqdm(
                total=total_rows,
                unit="row",
                desc="rows",
                position=1,
                file=events.stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )
            events._bar_writer = lambda line: tqdm.write(line, file=events.stream)

    def stats(self) -> dict[str, Any]:
        """Throughput and acceptance so far."""
        elapsed = max(1e-9, time.monotonic() - self.started)
        return {
            "rows": self.rows,
            "total_rows": self.total_rows,
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": tokens_per_s(self.output_tokens, elapsed),
            "acceptance_rate": acceptance_rate(self.accepted, self.drafted),
            "mean_acceptance_length": mean_acceptance_length(self.accepted, self.spec_steps),
        }

    def row_done(self, result: dict) -> None:
        self.rows += 1
        if result.get("error") is not None:
            self.errors += 1
        self.output_tokens += result.get("num_output_tokens") or 0
        self.drafted += result.get("spec_num_draft_tokens") or 0
        self.accepted += result.get("spec_num_accepted_tokens") or 0
        self.spec_steps += result.get("spec_num_steps") or 0
        if self._row_bar is not None:
            self._row_bar.update(1)
            if self.rows % 16 == 0 or self.rows == self.total_rows:
                self._row_bar.set_postfix_str(self._postfix(), refresh=False)
        else:
            self._maybe_log()

    def rows_dropped(self, count: int) -> None:
        """Rows that will not be produced (a skipped bad shard): shrink the total."""
        self._total(self.total_rows - count)

    def rows_restored(self, count: int) -> None:
        """Rows dropped earlier that will be produced after all (a busy shard handed out again,
        a dead replica's rows to be done again): grow the total."""
        self._total(self.total_rows + count)

    def _total(self, total_rows: int) -> None:
        self.total_rows = total_rows
        if self._row_bar is not None:
            self._row_bar.total = self.total_rows
            self._row_bar.refresh()

    def shard_done(self) -> None:
        self.shards += 1
        if self._shard_bar is not None:
            self._shard_bar.update(1)

    def _postfix(self) -> str:
        s = self.stats()
        parts = [f"{s['output_tokens_per_s']:.0f} tok/s"]
        if s["acceptance_rate"] is not None:
            parts.append(f"accept {s['acceptance_rate']:.2f}")
            parts.append(f"len {s['mean_acceptance_length']:.2f}")
        if self.errors:
            parts.append(f"errors {self.errors}")
        return ", ".join(parts)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._last_log = now
            s = self.stats()
            elapsed = now - self.started
            rate = self.rows / elapsed if elapsed > 0 else 0
            eta = (self.total_rows - self.rows) / rate if rate > 0 else None
            self.events.emit(
                "progress",
                f"progress {self.rows}/{self.total_rows} rows",
                shards_done=self.shards,
                total_shards=self.total_shards,
                eta_s=round(eta, 1) if eta is not None else None,
                **s,
            )

    def close(self) -> None:
        for bar in (self._row_bar, self._shard_bar):
            if bar is not None:
                bar.close()
        self.events._bar_writer = None
