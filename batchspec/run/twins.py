"""Identical requests generated once (``execution.dedupe_window``).

A batch runner sees the whole dataset, which an engine never does: rows that ask for the same
thing (the same prompt or messages, the same LoRA adapter, the same per-row sampling) and whose
result is determined by what they ask (greedy, or sampled with a seed) are sent to the engine
once; every other such row, its *twin*, gets a copy of the result, with ``twin_of`` naming the
row that was generated, and null speculative-decoding and timing columns (nothing ran for it).

Memory stays bounded: the results of at most ``window`` requests are kept for twins that come
later (the least recently used go first; results with logprobs, which can be large, are not
kept), and at most ``hold`` rows (the job's ``execution.max_in_flight``) wait at once, held back
for a request still in the engine or answered and not yet written; a row beyond that is simply
generated. A row whose result a seed
or temperature 0 does not fix (sampled, no seed) and a row the reader refused are never served
from a twin; a request the engine refused (too long, say) gives its twins the same error; the
twins of a request that a stopping run aborts are not written, so their shards are not
committed, as for any row still in flight.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from batchspec.io.rows import Row

#: Result columns a twin does not copy: nothing was generated or timed for it.
NOT_COPIED = ("spec_num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens",
              "spec_acceptance_rate", "spec_mean_acceptance_length",
              "spec_acceptance_histogram", "time_queued_s", "time_to_first_token_s",
              "time_decode_s", "time_e2e_s", "output_tokens_per_s")
TWIN_OF = "twin_of"
#: Result columns that can hold thousands of values: results with them are not kept for later.
_LARGE = ("token_logprobs", "top_logprobs", "prompt_token_logprobs", "prompt_top_logprobs")


def request_key(row: Row, sampling: dict[str, Any]) -> bytes | None:
    """What a row asks the engine, hashed; None when its result is not fixed by that (sampled
    without a seed, or a temperature left to the model's defaults) or it is an error row."""
    if row.error is not None:
        return None
    merged = {**sampling, **row.overrides}
    if merged.get("seed") is None and merged.get("temperature") != 0:
        return None
    asked = [row.prompt, row.messages, row.lora, sorted(row.overrides.items())]
    return hashlib.blake2b(json.dumps(asked, sort_keys=True, default=str).encode(),
                           digest_size=16).digest()


def twin_results(results: list[dict], of: str) -> list[dict]:
    """A copy of a generated request's result rows for its twin."""
    return [{**r, **dict.fromkeys(NOT_COPIED), TWIN_OF: of} for r in results]


class Twins:
    """Holds back twins of requests in flight and serves them when the request finishes."""

    def __init__(self, sampling: dict[str, Any], window: int, hold: int):
        self.sampling, self.window, self.hold = dict(sampling), window, hold
        #: key -> the request id of the row sent to the engine for it
        self._in_flight: dict[bytes, str] = {}
        #: key -> twins waiting for it
        self._waiting: dict[bytes, list[Row]] = {}
        self._held = 0
        #: key -> (request id, results) of a finished request, least recently used first
        self._done: OrderedDict[bytes, tuple[str, list[dict]]] = OrderedDict()
        #: twins answered from ``_done`` as they were read, for the caller to write
        self._ready: list[tuple[Row, list[dict]]] = []
        self._keys: dict[int, bytes] = {}

    def primaries(self, rows: Iterator[Row]) -> Iterator[Row]:
        """``rows`` without the twins held back (the engine's input)."""
        for row in rows:
            key = request_key(row, self.sampling) if self.window else None
            if key is None:
                yield row
            elif key in self._done and self._held + len(self._ready) < self.hold:
                self._done.move_to_end(key)
                of, results = self._done[key]
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
        was answered from finished results since the last call."""
        out, self._ready = self._ready, []
        key = self._keys.pop(id(row), None)
        if key is None:
            return out
        self._in_flight.pop(key, None)
        twins = self._waiting.pop(key, [])
        self._held -= len(twins)
        # a refusal is a twin's answer too: the same request is refused the same way
        if not any(r.get(c) for r in results for c in _LARGE):
            self._done[key] = (row.request_id, results)
            while len(self._done) > self.window:
                self._done.popitem(last=False)
        return out + [(t, twin_results(results, row.request_id)) for t in twins]

    def ready(self) -> list[tuple[Row, list[dict]]]:
        """Twins answered from finished results and not yet handed out."""
        out, self._ready = self._ready, []
        return out
