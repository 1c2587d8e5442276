"""Shared prefixes together (``execution.prefix_window``), the pacing half.

vLLM V1's prefix cache serves a request's leading KV blocks from an earlier request only once a
step has computed them: two requests with the same first block scheduled in the same step each
compute it. :class:`PrefixPacer` tells :meth:`batchspec.engine.llm.Engine.stream` which requests
to hold back: the first request with a given first block (of ``block_size`` prompt tokens, the
engine's cache block) goes at once; others with that block wait until the steps its prefill
needs have run (its prompt over the engine's token budget per step), then go together and read
the cached blocks. A request shorter than one block, or one whose prefix was computed already,
is never held. Only the stream's step count is used: nothing is asked of the engine."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: First blocks remembered (least recently seen forgotten first): a few MB of integers.
MEMORY = 65536


class PrefixPacer:
    """When a prepared request may enter the engine (see the module docstring)."""

    def __init__(self, block_size: int, tokens_per_step: int, memory: int = MEMORY):
        self.block_size = max(1, block_size)
        self.tokens_per_step = max(1, tokens_per_step)
        self.memory = memory
        #: hash of a first block -> the stream step from which its blocks are cached
        self.ready: OrderedDict[int, int] = OrderedDict()
        #: requests held back so far (for the run's figures and the tests)
        self.held = 0

    def hold_until(self, token_ids: Sequence[int], step: int) -> int | None:
        """The step to hold a request until, or None to send it now (``step``: engine steps the
        stream has run so far)."""
        if len(token_ids) <= self.block_size:
            return None  # no full block to share
        key = hash(tuple(token_ids[: self.block_size]))
        ready = self.ready.get(key)
        if ready is None:  # the first: it computes the prefix
            self.ready[key] = step + -(-len(token_ids) // self.tokens_per_step)
            if len(self.ready) > self.memory:
                self.ready.popitem(last=False)
            return None
        self.ready.move_to_end(key)
        if ready <= step:
            return None
        self.held += 1
        return ready
