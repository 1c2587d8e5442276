"""Identical requests generated once (``execution.dedupe_window``).

A batch runner sees the whole dataset, which an engine never does: rows that ask for the same
thing (the same prompt or messages, the same LoRA adapter, the same per-row sampling) and whose
result is determined by what they ask (greedy, or sampled with a seed) are sent to the engine
once; every other such row, its *twin*, gets a copy of the result, with ``twin_of`` naming the
row that was generated, and null speculative-decoding and timing columns (nothing ran for it).

Memory stays bounded: the results of at most ``window`` requests are kept for twins that come
later, holding at most about ``max_bytes`` (``execution.dedupe_max_bytes``, estimated per result
from its texts, lists and numbers: :func:`result_bytes`); the least recently used go first, and
a later twin of an evicted result is simply generated again (results with logprobs, which can be
large, and a result larger than the whole bound are not kept). At most ``hold`` rows (the job's
``execution.max_in_flight``) wait at once, held back for a request still in the engine or
answered and not yet written; a row beyond that is simply generated. Eviction never strands a
row: a twin waiting for a request in flight is handed that request's own result when it
finishes, never one from the cache, and a twin answered from the cache takes its copy at once.

A row whose result a seed or temperature 0 does not fix (sampled, no seed) and a row the reader
refused are never served from a twin. Only an answer is shared: a result with an error in any
sample (or a sample vLLM ended with ``abort``) is neither copied to the waiting twins nor kept.
An engine error (``engine error: ...``) is not a property of the request (the same request may
well succeed), and a refusal (a prompt too long, a bad per-row override, an unknown adapter,
one vLLM refuses) costs little to meet again, as it is refused before the engine runs it; so
no error is shared, whatever its kind, and none is told apart by its message. Instead one of
the waiting twins is sent to the engine next, before the rest of the input, and the others wait
for it in turn. Where the input has run out by then, :meth:`Twins.retries` gives those twins
as another stream's input (the caller streams it through the engine like the first). The twins
of a request that a stopping run aborts are not written, so their shards are not committed, as
for any row still in flight.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

from batchspec.io.rows import Row, asked_digest
from batchspec.spec.model import ExecutionSpec

#: Result columns a twin does not copy: nothing was generated or timed for it.
NOT_COPIED = (
    "spec_num_steps",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_acceptance_length",
    "spec_acceptance_histogram",
    "time_queued_s",
    "time_to_first_token_s",
    "time_decode_s",
    "time_e2e_s",
    "output_tokens_per_s",
)
TWIN_OF = "twin_of"
#: Result columns that can hold thousands of values: results with them are not kept for later.
_LARGE = ("token_logprobs", "top_logprobs", "prompt_token_logprobs", "prompt_top_logprobs")
#: Finish reasons that are not an answer to the request (the error column says why).
_NOT_ANSWERS = ("error", "abort")


def request_key(row: Row, sampling: dict[str, Any]) -> bytes | None:
    """What a row asks the engine, hashed; None when its result is not fixed by that (sampled
    without a seed, or a temperature left to the model's defaults) or it is an error row."""
    if row.error is not None:
        return None
    merged = {**sampling, **row.overrides}
    if merged.get("seed") is None and merged.get("temperature") != 0:
        return None
    return asked_digest(row)


def twin_results(results: list[dict], of: str) -> list[dict]:
    """A copy of a generated request's result rows for its twin."""
    return [{**r, **dict.fromkeys(NOT_COPIED), TWIN_OF: of} for r in results]


def is_answer(results: list[dict]) -> bool:
    """True when every sample of a result is the request's answer (no error, not aborted)."""
    return bool(results) and all(
        r.get("error") is None and r.get("finish_reason") not in _NOT_ANSWERS for r in results
    )


def result_bytes(results: list[dict]) -> int:
    """About the memory a result's rows hold: each row's dict and every value in it (texts at
    their size, lists with their items); column names are shared, so not counted. Linear in
    the values, paid once per result kept."""
    return sum(_bytes(r) for r in results)


def _bytes(value: Any) -> int:
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sys.getsizeof(value) + sum(_bytes(v) for v in value)
    if value is None or isinstance(value, bool):
        return 0  # one shared object
    return sys.getsizeof(value)


class Twins:
    """Holds back twins of requests in flight and serves them when the request finishes."""

    def __init__(
        self,
        sampling: dict[str, Any],
        window: int,
        hold: int,
        max_bytes: int = ExecutionSpec.dedupe_max_bytes,
    ):
        self.sampling, self.window, self.hold = dict(sampling), window, hold
        self.max_bytes = max_bytes
        #: key -> the request id of the row sent to the engine for it
        self._in_flight: dict[bytes, str] = {}
        #: key -> twins waiting for it
        self._waiting: dict[bytes, list[Row]] = {}
        #: rows waiting (``_waiting``, ``_again``); at most ``hold`` with ``_ready``
        self._held = 0
        #: key -> (request id, results, their estimated bytes) of a finished request, least
        #: recently used first
        self._done: OrderedDict[bytes, tuple[str, list[dict], int]] = OrderedDict()
        self._done_bytes = 0
        #: twins answered from ``_done`` as they were read, for the caller to write
        self._ready: list[tuple[Row, list[dict]]] = []
        #: twins whose request ended in an error, to send to the engine next (each already in
        #: ``_in_flight`` for its key, its own twins waiting for it)
        self._again: deque[Row] = deque()
        self._keys: dict[int, bytes] = {}

    @property
    def cached_bytes(self) -> int:
        """The estimated bytes of the finished results kept for later twins."""
        return self._done_bytes

    def primaries(self, rows: Iterator[Row]) -> Iterator[Row]:
        """``rows`` without the twins held back (the engine's input), and before each of them
        the twins to send again (:meth:`finished`)."""
        rows = iter(rows)
        while True:
            if self._again:
                self._held -= 1
                yield self._again.popleft()
                continue
            row = next(rows, None)
            if row is None:
                return
            key = request_key(row, self.sampling) if self.window else None
            if key is None:
                yield row
            elif key in self._done and self._held + len(self._ready) < self.hold:
                self._done.move_to_end(key)
                of, results, _ = self._done[key]
                self._ready.append((row, twin_results(results, of)))
            elif key in self._in_flight and self._held + len(self._ready) < self.hold:
                self._waiting.setdefault(key, []).append(row)
                self._held += 1
            else:
                if key not in self._in_flight:
                    self._in_flight[key] = row.request_id
                    self._keys[id(row)] = key
                yield row

    def finished(self, row: Row, results: list[dict]) -> list[tuple[Row, list[dict]]]:
        """A request the engine finished: its waiting twins with their results, and whatever
        was answered from finished results since the last call. Where the request ended in an
        error, its first waiting twin is sent to the engine next instead, the others waiting
        for that one."""
        out, self._ready = self._ready, []
        key = self._keys.pop(id(row), None)
        if key is None:
            return out
        self._in_flight.pop(key, None)
        twins = self._waiting.pop(key, [])
        if not is_answer(results):
            if twins:  # still held (``_held``), now in ``_again``
                first, rest = twins[0], twins[1:]
                self._in_flight[key] = first.request_id
                self._keys[id(first)] = key
                if rest:
                    self._waiting[key] = rest
                self._again.append(first)
            return out
        self._held -= len(twins)
        if not any(r.get(c) for r in results for c in _LARGE):
            self._keep(key, row.request_id, results)
        return out + [(t, twin_results(results, row.request_id)) for t in twins]

    def _keep(self, key: bytes, of: str, results: list[dict]) -> None:
        """Keep a finished result for later twins (without the columns they do not copy), the
        least recently used evicted past ``window`` results or ``max_bytes``."""
        kept = [{**r, **dict.fromkeys(NOT_COPIED)} for r in results]
        size = result_bytes(kept)
        if size > self.max_bytes:
            return
        old = self._done.pop(key, None)
        if old is not None:
            self._done_bytes -= old[2]
        self._done[key] = (of, kept, size)
        self._done_bytes += size
        while len(self._done) > self.window or self._done_bytes > self.max_bytes:
            _, (_, _, evicted) = self._done.popitem(last=False)
            self._done_bytes -= evicted

    def ready(self) -> list[tuple[Row, list[dict]]]:
        """Twins answered from finished results and not yet handed out."""
        out, self._ready = self._ready, []
        return out

    def retries(self) -> Iterator[Row] | None:
        """Once the engine's stream of :meth:`primaries` ended: the twins still to send because
        their request ended in an error after the input had run out, as the input of another
        stream through the engine (its results go to :meth:`finished` as before); None when
        there are none."""
        return self.primaries(iter(())) if self._again else None
