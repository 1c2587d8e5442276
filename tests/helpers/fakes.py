"""A fake engine for fast unit tests of the runner's I/O logic (never the only test of a
user-visible behaviour: tests/cli/test_e2e.py and tests/cli/test_cli_e2e.py run the same paths on
real vLLM), and ``batchspec`` as a process with it in place of vLLM."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from batchspec.columns import empty_result, error_result


class FakeEngine:
    """Echoes prompts upper-cased, finishing requests out of order like a real engine."""

    def __init__(self, seed: int = 0, fail_after: int | None = None, delay_s: float = 0.0):
        self.rng = random.Random(seed)
        self.fail_after = fail_after
        #: Seconds each request takes (a process to kill mid-run has to be slow enough).
        self.delay_s = delay_s
        self.max_seen_in_flight = 0
        self.finished = 0
        #: The spec of every job run on this engine, in order (``run_job`` binds it to each).
        self.bound: list = []

    def bind(self, spec):
        self.bound.append(spec)

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
                    yield row, [error_result(row.error)]
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
            if self.delay_s:
                time.sleep(self.delay_s)
            result = empty_result()
            text = (row.prompt or str(row.messages)).upper()
            result.update(
                generated_text=text,
                finish_reason="stop",
                num_prompt_tokens=len(text),
                num_output_tokens=len(text),
            )
            yield row, [result]

    def spec_counters(self):
        return {}

    def shutdown(self):
        pass


class TuneClock:
    """The clock tune's modules read while :class:`FakeTuneEngine` stands in for vLLM: it moves
    only when the fake engine "spends" time on a row, so what tune measures is exactly what the
    test set (a row's cost, a speed-up) and never how busy the machine running the suite is
    (with sleeps, a loaded CI machine once measured the 1.5x faster token budget 27% slower)."""

    #: Modules whose ``time.monotonic`` is this clock: every reading tune's timing and deadlines
    #: make, so a deadline is reached when the fake engine has spent the time.
    MODULES = (
        "batchspec.tune.measure",
        "batchspec.tune.knobs",
        "batchspec.tune.session",
        "batchspec.tune.auto",
    )

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):  # the rest of the time module, for the modules patched
        return getattr(time, name)


def use_fake_tune_engine(monkeypatch) -> TuneClock:
    """Put :class:`FakeTuneEngine` in place of vLLM's engine and :class:`TuneClock` in place of
    the clock of tune's modules; returns the clock."""
    import importlib

    import batchspec.engine.llm

    clock = TuneClock()
    monkeypatch.setattr(batchspec.engine.llm, "Engine", FakeTuneEngine)
    monkeypatch.setattr(FakeTuneEngine, "clock", clock)
    for name in TuneClock.MODULES:
        monkeypatch.setattr(importlib.import_module(name), "time", clock)
    return clock


class FakeTuneEngine:
    """Stands in for batchspec.engine.llm.Engine where only tune's bookkeeping is under test (the
    real engine runs the same paths in the `engine` tests above); install it with
    :func:`use_fake_tune_engine`, whose clock its rows advance. Draft position i is accepted
    with a fixed rate; ``lossy`` makes speculative candidates change one row's text; ``speedup``
    divides a speculative candidate's time per row; a draft whose path holds "refuse" is refused
    as vLLM refuses a config (its message quoting the path). ``started`` lists the speculative
    config of every engine made (None: speculation off)."""

    #: The clock a row's time is spent on (set by :func:`use_fake_tune_engine`).
    clock: TuneClock | None = None

    lossy = False
    speedup = 1.0
    started: list = []
    resets = 0
    #: ``f(max_num_seqs, max_num_batched_tokens, max_in_flight)`` -> how many times faster a
    #: batch configuration runs; None: time per row shrinks with the requests in flight.
    knob_speed = None
    #: Every engine's (max_num_seqs, max_num_batched_tokens) as vLLM would resolve them.
    batches: list = []

    def __init__(self, spec):
        from batchspec.errors import SpecError

        FakeTuneEngine.started.append(spec.speculative)
        self.max_num_seqs = spec.model.engine.get("max_num_seqs") or 256
        self.max_num_batched_tokens = spec.model.engine.get("max_num_batched_tokens") or 2048
        FakeTuneEngine.batches.append((self.max_num_seqs, self.max_num_batched_tokens))
        model = str((spec.speculative or {}).get("model", ""))
        if "refuse" in model:
            raise SpecError("speculative", f"vLLM cannot load the draft {model}")
        self.spec_enabled = spec.speculative is not None
        self.k = (spec.speculative or {}).get("num_speculative_tokens", 0)
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_accepted_tokens_per_pos": [0] * self.k}

    def stream(self, rows, max_in_flight):
        rates = [0.8, 0.6, 0.45, 0.3, 0.2, 0.1][: self.k]
        if self.knob_speed is None:
            per_row = 1 / max_in_flight
        else:
            per_row = 1 / self.knob_speed(self.max_num_seqs, self.max_num_batched_tokens, max_in_flight)
        for row in rows:
            steps = 10
            self.clock.sleep(0.001 * steps * (1 + 0.1 * self.k) * per_row / (self.speedup if self.k else 1.0))
            self.counters["spec_decode_num_drafts"] += steps
            for i, r in enumerate(rates):
                self.counters["spec_decode_num_accepted_tokens_per_pos"][i] += round(steps * r)
            text = f"text of {row.request_id}"
            if self.lossy and self.k:
                text += "!"
            yield (
                row,
                [
                    {
                        "generated_text": text,
                        "num_output_tokens": 24,
                        "error": None,
                        "time_e2e_s": 0.01,
                        "spec_num_draft_tokens": steps * self.k or None,
                        "spec_num_accepted_tokens": round(steps * sum(rates)) if self.k else None,
                        "spec_num_steps": steps if self.k else None,
                    }
                ],
            )

    def reset_prefix_cache(self):
        FakeTuneEngine.resets += 1
        return True

    def spec_counters(self):
        return json.loads(json.dumps(self.counters))

    def batch_config(self):
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_chunked_prefill": True,
        }

    def shutdown(self):
        pass


#: ``batchspec`` in a new Python process with :class:`FakeEngine` in place of vLLM: no model
#: loads, no engine starts. For tests of what a process does with its store (exit codes, kills,
#: flags) where the engine's own work is not the point. argv: the tests folder, then the command line.
#: ``BATCHSPEC_FAKE_ENGINE_DELAY_S`` sets :attr:`FakeEngine.delay_s`.
FAKE_ENGINE_CLI = """
import os, sys
sys.path.insert(0, sys.argv[1])
import batchspec.engine.llm
import batchspec.engine.checks
from helpers.fakes import FakeEngine
delay_s = float(os.environ.get("BATCHSPEC_FAKE_ENGINE_DELAY_S", "0"))
batchspec.engine.llm.Engine = lambda spec: FakeEngine(delay_s=delay_s)
batchspec.engine.checks.check_vllm_keys = lambda spec: None
batchspec.engine.checks.vllm_version = lambda: "none (fake engine)"
from batchspec.cli import main
sys.argv = ["batchspec", *sys.argv[2:]]
main()
"""


def fake_cli_command(*args: str) -> list[str]:
    """The command line of ``batchspec ARGS`` with the fake engine (see FAKE_ENGINE_CLI)."""
    return [sys.executable, "-c", FAKE_ENGINE_CLI, str(Path(__file__).resolve().parents[1]), *args]


def run_fake_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``batchspec ARGS`` with the fake engine, capturing its output."""
    return subprocess.run(
        fake_cli_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parents[2],
    )


class DyingEngine(FakeEngine):
    """The fake engine that dies as vLLM's does (batchspec/engine/supervise.py's EngineDied,
    with the rows in flight and those not sent): whenever a row whose prompt holds ``poison`` is
    among those in flight, and after each of the ``deaths_after`` numbers of finished requests
    (once each). It fills up to ``max_in_flight`` before each step and finishes the oldest
    request first. ``restart()`` starts it again; the first ``failed_starts`` starts fail."""

    def __init__(self, poison: str | None = None, deaths_after=(), failed_starts: int = 0):
        super().__init__()
        self.poison = poison
        self.deaths_after = list(deaths_after)
        self.failed_starts = failed_starts
        self.starts = 1
        #: the rows in flight at each death
        self.deaths: list[list[str]] = []
        #: the request ids sent, in order, over every engine
        self.sent: list[str] = []

    def restart(self):
        self.starts += 1
        if self.failed_starts:
            from batchspec.errors import RuntimeFailure

            self.failed_starts -= 1
            raise RuntimeFailure("could not start the vLLM engine: killed while starting")

    def stream(self, rows, max_in_flight, stop=None, grace_s=0.0, keep=None):
        from batchspec.engine.supervise import EngineDied

        in_flight = []
        while True:
            while len(in_flight) < max_in_flight:
                row = next(rows, None)
                if row is None:
                    break
                if row.error is not None:
                    yield row, [error_result(row.error)]
                    continue
                in_flight.append(row)
                self.sent.append(row.request_id)
            if not in_flight:
                return
            poisoned = self.poison is not None and any(
                self.poison in f"{r.prompt} {r.pair or ''}" for r in in_flight
            )
            scheduled = bool(self.deaths_after) and self.finished >= self.deaths_after[0]
            if poisoned or scheduled:
                if scheduled and not poisoned:
                    self.deaths_after.pop(0)
                self.deaths.append([r.request_id for r in in_flight])
                why = "poisoned" if poisoned else "killed"
                raise EngineDied(f"the vLLM engine failed: {why}", f"EngineDeadError: {why}", in_flight)
            row = in_flight.pop(0)
            self.finished += 1
            result = empty_result()
            result.update(generated_text=row.prompt.upper(), finish_reason="stop", num_output_tokens=1)
            yield row, [result]
