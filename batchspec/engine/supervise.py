"""Supervision of a run's engine: a dead engine is restarted in place, and a request that kills
it is found and becomes an error row.

:meth:`batchspec.engine.llm.Engine.stream` raises :class:`EngineDied` when its engine dies (a
step fails, its watchdog sees an engine process gone, or ``add_request`` finds it dead), with
the rows it had sent and had no result for (``in_flight``) and those it had taken but not sent
(``unsent``). A :class:`Supervisor` wraps that stream for a run (the executors make one per run,
or per run and Ray replica):

- **Restart in place.** It starts a new engine with the same configuration
  (:meth:`Engine.restart`, which shuts down what is left of the old one and kills its processes),
  sends those rows again before any new one, and goes on. What was yielded stays yielded: a row
  is sent again only while it has no result, so none is written twice, and its shard commits as
  usual. ``execution.engine_restarts`` bounds the engine starts this costs a run (a start that
  fails, say killed while loading, counts too); one more death ends the run (RuntimeFailure,
  exit 1), as one death did before.
- **Quarantine.** Each row counts the deaths it was in flight for. When the engine dies with a
  row in flight that was in flight at an earlier death too, the rows in flight both times (the
  suspects) are sent again in halves, each half alone on the engine: a half that kills it is
  halved again, and where the first half lives the second is halved without being run whole (a
  pair runs one row at a time). A row that kills the engine with no other row in flight is
  quarantined: it
  becomes an error row (``the engine died on this request (N times): <reason>``, committed like
  any other, so a rerun never sends it again), and so does a later row asking the same. Every
  other suspect finishes along the way or goes back to the run. One death's search costs at
  most ``ceil(log2(rows in flight)) + 2`` restarts beyond ``execution.engine_restarts``: each
  death in it at least halves the rows still suspected.

What it did is reported to the run (``report``: :class:`Report`'s two methods), which counts it in
the summary and emits the events."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from batchspec.columns import error_result
from batchspec.errors import Interrupted, RuntimeFailure, SpecError
from batchspec.io.rows import Row, asked_digest


class EngineDied(RuntimeFailure):
    """The engine died during :meth:`Engine.stream`. A run that does not supervise its engine
    ends with it as before (exit 1, its message naming the requests sent since the last good
    step); a :class:`Supervisor` restarts the engine and sends ``in_flight`` and ``unsent`` again."""

    def __init__(self, message: str, reason: str, in_flight: Iterable[Row] = (), unsent: Iterable[Row] = ()):
        super().__init__(message)
        #: What killed it, in a few words (the error vLLM or the watchdog raised)
        self.reason = reason
        #: rows sent to the engine with no result yet, oldest first
        self.in_flight = list(in_flight)
        #: rows taken from the input but not sent yet
        self.unsent = list(unsent)


def quarantine_error(deaths: int, reason: str) -> str:
    """The error of a quarantined request's row."""
    return f"the engine died on this request ({deaths} times): {reason}"


@dataclasses.dataclass
class Restart:
    """One engine brought up again (what the ``engine_restarted`` event and the summary say)."""

    #: what killed the engine
    reason: str
    #: requests it had when it died, all sent again (what the death cost beside the restart)
    in_flight: int
    #: from the death's notice to the new engine's readiness, failed starts included
    seconds: float
    #: engine starts it took (more than one where a start failed)
    attempts: int
    #: a restart of a quarantine search (beyond ``execution.engine_restarts``)
    search: bool
    #: restarts ``execution.engine_restarts`` still allows this run
    restarts_left: int

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}


class Report(Protocol):
    """What the run is told (batchspec/run/outcome.py's ``SupervisionLog``)."""

    def restarted(self, restart: Restart) -> None: ...

    def quarantined(self, row: Row, deaths: int, reason: str) -> None: ...


class _Quiet:
    def restarted(self, restart: Restart) -> None:
        pass

    def quarantined(self, row: Row, deaths: int, reason: str) -> None:
        pass


def supervise(engine, restarts: int, report: Report | None = None, starting=None) -> Supervisor | None:
    """A :class:`Supervisor` of ``engine``, or None for an engine that cannot restart (a test's
    stand-in): the run then streams from the engine itself."""
    if not callable(getattr(engine, "restart", None)):
        return None
    return Supervisor(engine, restarts, report, starting)


class Supervisor:
    """Streams rows through ``engine`` across its deaths (see the module's docstring).

    ``restarts``: ``execution.engine_restarts``, for the supervisor's whole life (one run).
    ``report``: told of each restart and quarantine (may be replaced between streams).
    ``starting``: a context manager each engine start runs in (the local run's makes a signal
    end a start at once, as at the run's first start)."""

    def __init__(
        self,
        engine,
        restarts: int,
        report: Report | None = None,
        starting: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        self.engine = engine
        self.restarts = restarts
        self.restarts_left = restarts
        self.report: Report = report or _Quiet()
        self.starting = starting or contextlib.nullcontext
        #: id(row) -> deaths it was in flight for (rows without a result only: alive, so ids
        #: are not reused)
        self._deaths: dict[int, int] = {}
        #: what a quarantined request asks -> (deaths, reason, its request id)
        self._killers: dict[bytes, tuple[int, str, str]] = {}
        #: rows answered as a quarantined request's twins, waiting to be yielded
        self._refused: list[tuple[Row, list[dict]]] = []

    # ------------------------------------------------------------------ the stream

    def stream(
        self,
        rows: Iterator[Row],
        max_in_flight: int,
        stop: Callable[[], bool] | None = None,
        grace_s: float = 0.0,
        keep: Callable[[Row], bool] | None = None,
    ) -> Iterator[tuple[Row, list[dict]]]:
        """:meth:`Engine.stream`'s contract (same arguments, each row yielded once with its
        result rows), through deaths of the engine."""
        stop = stop or (lambda: False)
        rows = iter(rows)
        again: deque[Row] = deque()  # rows to send before any new one
        while True:
            try:
                yield from self._each(self._source(again, rows), max_in_flight, stop, grace_s, keep)
                yield from self._flush()
                return
            except EngineDied as death:
                again.extendleft(reversed([*death.in_flight, *death.unsent]))
                self._count(death)
                if stop():
                    raise  # a stopping run ends: nothing is restarted for it
                suspects = [r for r in death.in_flight if self._deaths.get(id(r), 0) >= 2]
                self._restart(death, search=False, suspects=suspects)
                if suspects:
                    yield from self._search(death, suspects, again, max_in_flight, stop, grace_s, keep)

    def _each(self, rows, max_in_flight, stop, grace_s, keep) -> Iterator[tuple[Row, list[dict]]]:
        """One :meth:`Engine.stream` (closed when this one is: it aborts what is in flight)."""
        with contextlib.closing(self.engine.stream(rows, max_in_flight, stop, grace_s, keep)) as inner:
            for row, results in inner:
                self._deaths.pop(id(row), None)
                yield row, results
                yield from self._flush()

    def _source(self, again: deque[Row], rows: Iterator[Row]) -> Iterator[Row]:
        """The rows to send again, then the input; a row asking what a quarantined request asked
        is answered with its error instead."""
        while True:
            row = again.popleft() if again else next(rows, None)
            if row is None:
                return
            killer = self._killers.get(asked_digest(row)) if self._killers and row.error is None else None
            if killer is not None:
                deaths, reason, request_id = killer
                why = f"{quarantine_error(deaths, reason)} (request {request_id!r}, the same request)"
                self._refused.append((row, [error_result(why)]))
                continue
            yield row

    def _flush(self) -> Iterator[tuple[Row, list[dict]]]:
        while self._refused:
            yield self._refused.pop(0)

    def _count(self, death: EngineDied) -> None:
        for row in death.in_flight:
            self._deaths[id(row)] = self._deaths.get(id(row), 0) + 1

    # ------------------------------------------------------------------ quarantine

    def _search(
        self,
        death: EngineDied,
        suspects: list[Row],
        again: deque[Row],
        max_in_flight: int,
        stop: Callable[[], bool],
        grace_s: float,
        keep: Callable[[Row], bool] | None,
    ) -> Iterator[tuple[Row, list[dict]]]:
        """Find which suspects kill the engine alone: they die together, so their halves run
        alone on the engine, the first half first; where it lives the second is the one that
        kills (halved again without being run whole), where it dies its rows are; a pair runs
        one row at a time, and a row that kills the engine on its own is quarantined. At most
        ``ceil(log2(in flight)) + 2`` restarts. What is not settled when the search ends goes
        back to ``again``."""
        taken = {id(r) for r in suspects}
        for row in [r for r in again if id(r) in taken]:
            again.remove(row)
        if len(death.in_flight) == 1:  # it killed the engine alone (and had before)
            yield from self._quarantine(suspects[0], death.reason)
            return
        bound = math.ceil(math.log2(len(death.in_flight))) + 2
        groups: deque[_Group] = deque(_split(suspects))
        used = 0
        while groups:
            group = groups.popleft()
            if group.dead and len(group.rows) > 1:
                groups.extendleft(reversed(_split(group.rows)))
                continue
            # a pair one row at a time: its death as a pair would tell nothing a row's does not
            parts = deque([r] for r in group.rows) if len(group.rows) == 2 else deque([group.rows])
            lived = True
            while parts:
                if stop() or used >= bound:
                    groups.extendleft(_Group(part) for part in reversed(parts))
                    break
                died = yield from self._alone(parts.popleft(), again, max_in_flight, stop, grace_s, keep)
                if died is None:
                    continue
                lived = False
                used += 1
                if len(died.in_flight) == 1:
                    yield from self._quarantine(died.in_flight[0], died.reason)
                elif died.in_flight:
                    groups.extendleft(reversed(_split(died.in_flight)))
            else:
                if lived and group.sibling is not None:
                    group.sibling.dead = True  # their parent killed the engine, this half did not
                continue
            break  # stopping, or the bound reached
        for group in reversed(groups):  # unsettled: sent again with the rest of the run
            again.extendleft(reversed(group.rows))

    def _alone(
        self,
        rows: list[Row],
        again: deque[Row],
        max_in_flight: int,
        stop: Callable[[], bool],
        grace_s: float,
        keep: Callable[[Row], bool] | None,
    ) -> Iterator[tuple[Row, list[dict]]]:
        """Run ``rows`` alone on the engine, yielding their results; returns the death, after the
        restart (None where it lived). Rows it never sent go back to ``again``."""
        try:
            yield from self._each(iter(rows), max_in_flight, stop, grace_s, keep)
            return None
        except EngineDied as died:
            self._count(died)
            again.extendleft(reversed(died.unsent))  # never sent: not suspected by this death
            if stop():
                again.extendleft(reversed(died.in_flight))
                raise
            self._restart(died, search=True)
            return died

    def _quarantine(self, row: Row, reason: str) -> Iterator[tuple[Row, list[dict]]]:
        deaths = self._deaths.pop(id(row), 0)
        self._killers[asked_digest(row)] = (deaths, reason, row.request_id)
        self.report.quarantined(row, deaths, reason)
        yield row, [error_result(quarantine_error(deaths, reason))]

    # ------------------------------------------------------------------ restarts

    def _restart(self, death: EngineDied, search: bool, suspects: list[Row] = ()) -> None:
        """A new engine in place of the dead one; RuntimeFailure (exit 1) once
        ``execution.engine_restarts`` is spent. A start that fails is one more restart.
        ``suspects``: requests in flight at this death and an earlier one, named where the budget
        ends the run before their quarantine search could start."""
        if not search:
            self._spend(death, suspects)
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            try:
                with self.starting():
                    self.engine.restart()
                break
            except (Interrupted, SpecError):
                raise
            except RuntimeFailure as failed:
                self._spend(failed)
        self.report.restarted(
            Restart(
                death.reason,
                len(death.in_flight),
                time.monotonic() - started,
                attempts,
                search,
                self.restarts_left,
            )
        )

    def _spend(self, cause: RuntimeFailure, suspects: list[Row] = ()) -> None:
        if self.restarts_left <= 0:
            why = ""
            if suspects:
                names = ", ".join(repr(r.request_id) for r in suspects[:5])
                more = f" and {len(suspects) - 5} more" if len(suspects) > 5 else ""
                why = (
                    f"; {names}{more} was in flight at two deaths and would have been searched "
                    "for a request that kills the engine, but the two deaths that reveal one are "
                    "two of execution.engine_restarts: at least 2 lets a run quarantine it"
                )
            raise RuntimeFailure(
                f"{cause} (after {self.restarts} engine restarts in this run, all that "
                f"execution.engine_restarts allows{why})"
            ) from cause
        self.restarts_left -= 1


@dataclasses.dataclass
class _Group:
    """Suspects to run alone on the engine in a quarantine search."""

    rows: list[Row]
    #: known to kill the engine (its first half lived): halved without being run whole
    dead: bool = False
    #: the second half of its parent, for the first: dead where this one lives
    sibling: _Group | None = None


def _split(rows: list[Row]) -> list[_Group]:
    """The halves of rows that killed the engine together (one group for a single row, known
    dead)."""
    half = len(rows) // 2
    if not half:
        return [_Group(rows, dead=True)]
    second = _Group(rows[half:])
    return [_Group(rows[:half], sibling=second), second]


def add_counters(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two engines' :meth:`Engine.spec_counters` as one (a restarted engine counts from 0):
    numbers added, lists added position by position."""
    out = dict(b)
    for name, value in a.items():
        other = b.get(name)
        if isinstance(value, list):
            other = other if isinstance(other, list) else []
            size = max(len(value), len(other))
            out[name] = [
                (value[i] if i < len(value) else 0) + (other[i] if i < len(other) else 0) for i in range(size)
            ]
        elif isinstance(value, int | float):
            out[name] = value + (other if isinstance(other, int | float) else 0)
    return out


#: How long :func:`death_note` waits for a dead process's exit status: a killed process of a few
#: GiB is seen gone (its sockets closed, vLLM's client raising) before the kernel has finished
#: tearing it down and its status can be read, the longer the busier the machine.
EXIT_STATUS_WAIT_S = 3.0


def death_note(core, processes: list[tuple[Any, str]]) -> str | None:
    """Which of an engine's processes (psutil's, with their names) died, and how (its exit code
    or the signal that killed it, where vLLM started it), for the error that ends its stream;
    None when none is seen dead."""
    import signal
    import time

    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    started = getattr(manager, "processes", None) or ()

    def exit_codes() -> dict[int, int | None]:
        codes: dict[int, int | None] = {}
        for proc in started:
            try:
                codes[proc.pid] = proc.exitcode
            except Exception:  # noqa: BLE001 (best effort: the note only names the death)
                continue
        return codes

    codes = exit_codes()
    deadline = time.monotonic() + EXIT_STATUS_WAIT_S
    while (
        codes
        and all(code is None for code in codes.values())
        and any(not _running(p) for p, _ in processes)
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)  # one of them is dying: its status comes once the kernel is done
        codes = exit_codes()
    dead = []
    for p, name in processes:
        if _running(p):
            continue
        dead.append((codes.get(p.pid) is None, p.pid, name))  # one whose end is known first
    if not dead:
        return None
    _, pid, name = min(dead)
    what, code = f"{name} (pid {pid}) died", codes.get(pid)
    if code is not None and code < 0:
        try:
            what += f", killed by {signal.Signals(-code).name}"
        except ValueError:
            what += f", exit code {code}"
    elif code is not None:
        what += f", exit code {code}"
    return what


def _running(p) -> bool:
    """Whether psutil's ``p`` runs (a zombie has ended)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
