"""A fake engine for fast unit tests of the runner's I/O logic (never the only test of a
user-visible behaviour: tests/test_e2e.py and tests/test_cli_e2e.py run the same paths on
real vLLM)."""

from __future__ import annotations

import random

from batchspec.columns import empty_result, error_result


class FakeEngine:
    """Echoes prompts upper-cased, finishing requests out of order like a real engine."""

    def __init__(self, seed: int = 0, fail_after: int | None = None):
        self.rng = random.Random(seed)
        self.fail_after = fail_after
        self.max_seen_in_flight = 0
        self.finished = 0

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        """The real engine's contract: completion order, at most ``max_in_flight`` at once, and
        after ``stop()`` no new rows and only the ``keep`` ones finish (no grace timing here)."""
        in_flight = []
        exhausted = False
        stopping = False
        while True:
            if not stopping and stop is not None and stop():
                stopping = exhausted = True
                in_flight = [r for r in in_flight if keep is None or keep(r)]
            while not exhausted and len(in_flight) < max_in_flight:
                row = next(rows, None)
                if row is None:
                    exhausted = True
                elif row.error is not None:
                    yield row, error_result(row.error)
                else:
                    in_flight.append(row)
            self.max_seen_in_flight = max(self.max_seen_in_flight, len(in_flight))
            if not in_flight:
                return
            row = in_flight.pop(self.rng.randrange(len(in_flight)))
            if self.fail_after is not None and self.finished >= self.fail_after:
                from batchspec.errors import RuntimeFailure

                raise RuntimeFailure("the vLLM engine failed: EngineDeadError: fake")
            self.finished += 1
            result = empty_result()
            text = (row.prompt or str(row.messages)).upper()
            result.update(generated_text=text, finish_reason="stop", num_prompt_tokens=len(text),
                          num_output_tokens=len(text))
            yield row, result

    def spec_counters(self):
        return {}

    def shutdown(self):
        pass
