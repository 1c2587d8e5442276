"""batchspec/engine/supervise.py on the fake engine that dies (tests/helpers/fakes.py's
DyingEngine): restarts in place, the quarantine search and its bound, the restart budget, stops.
The same on vLLM, with real deaths: tests/run/test_supervision.py."""

from __future__ import annotations

import math

import pytest
from helpers.fakes import DyingEngine

from batchspec.engine.supervise import EngineDied, Supervisor, add_counters, quarantine_error, supervise
from batchspec.errors import RuntimeFailure
from batchspec.io.rows import Row


class Told:
    """A report that keeps what the supervisor says."""

    def __init__(self):
        self.restarts, self.quarantines = [], []

    def restarted(self, restart):
        self.restarts.append(restart)

    def quarantined(self, row, deaths, reason):
        self.quarantines.append((row.request_id, deaths, reason))


def rows(n: int, poisoned=(), twins=()) -> list[Row]:
    out = []
    for i in range(n):
        prompt = f"prompt {i}" + (" POISON" if i in poisoned else "")
        if i in twins:
            prompt = f"prompt {twins[i]} POISON"
        out.append(Row(shard="s", index=i, request_id=f"r{i}", kept={}, prompt=prompt))
    return out


def results(supervisor, rows_, max_in_flight=4, **kw) -> dict[str, dict]:
    """Each request id's one result (a row yielded twice fails)."""
    seen: dict[str, dict] = {}
    for row, res in supervisor.stream(iter(rows_), max_in_flight, **kw):
        assert row.request_id not in seen, f"{row.request_id} yielded twice"
        assert len(res) == 1
        seen[row.request_id] = res[0]
    return seen


def test_a_death_restarts_the_engine_and_its_requests_are_sent_again():
    engine, told = DyingEngine(deaths_after=[5]), Told()
    out = results(Supervisor(engine, 3, told), rows(20))
    assert sorted(out) == sorted(f"r{i}" for i in range(20))
    assert all(r["generated_text"] == f"PROMPT {r_id[1:]}" for r_id, r in out.items())
    assert engine.starts == 2 and len(engine.deaths) == 1
    (restart,) = told.restarts
    assert restart.reason == "EngineDeadError: killed" and restart.attempts == 1
    assert not restart.search and restart.restarts_left == 2
    # the rows in flight at the death were the first sent to the new engine
    resent = engine.sent[engine.sent.index(engine.deaths[0][-1]) + 1 :][: len(engine.deaths[0])]
    assert resent == engine.deaths[0]


def test_two_deaths_with_the_same_requests_search_them_and_quarantine_none_that_live():
    engine, told = DyingEngine(deaths_after=[5, 5]), Told()  # the second right after the restart
    out = results(Supervisor(engine, 3, told), rows(20))
    assert len(out) == 20 and not any(r["error"] for r in out.values())
    assert engine.deaths[0] == engine.deaths[1]
    assert [r.search for r in told.restarts] == [False, False]  # halves ran alone and lived
    assert told.quarantines == []


@pytest.mark.parametrize("in_flight", [1, 3, 8, 16])
def test_a_request_that_kills_the_engine_is_quarantined_within_the_bound(in_flight):
    engine, told = DyingEngine(poison="POISON"), Told()
    out = results(Supervisor(engine, 3, told), rows(60, poisoned={33}), max_in_flight=in_flight)
    assert len(out) == 60
    errors = {k: r["error"] for k, r in out.items() if r["error"]}
    deaths = len(engine.deaths)
    assert errors == {"r33": quarantine_error(deaths, "EngineDeadError: poisoned")}, errors
    assert out["r33"]["finish_reason"] == "error"
    assert told.quarantines == [("r33", deaths, "EngineDeadError: poisoned")]
    assert [r.search for r in told.restarts[:2]] == [False, False]  # it killed the engine twice
    search = [r for r in told.restarts if r.search]
    assert len(search) <= math.ceil(math.log2(in_flight)) + 2
    assert len(told.restarts) == deaths and told.restarts[-1].restarts_left == 1


def test_three_poisoned_rows_among_200_leave_197_answers():
    engine, told = DyingEngine(poison="POISON"), Told()
    out = results(Supervisor(engine, 6, told), rows(200, poisoned={17, 100, 180}), max_in_flight=8)
    assert len(out) == 200
    assert sorted(k for k, r in out.items() if r["error"]) == ["r100", "r17", "r180"]
    assert all(
        out[k]["error"].startswith("the engine died on this request (") for k in ("r17", "r100", "r180")
    )
    assert sum(1 for r in out.values() if r["generated_text"]) == 197
    assert len([r for r in told.restarts if not r.search]) == 6  # two deaths each


def test_poison_in_one_batch_is_found_in_one_search():
    engine, told = DyingEngine(poison="POISON"), Told()
    out = results(Supervisor(engine, 3, told), rows(40, poisoned={0, 1, 2}), max_in_flight=3)
    assert sorted(k for k, r in out.items() if r["error"]) == ["r0", "r1", "r2"]
    assert len([r for r in told.restarts if not r.search]) == 2
    assert len([r for r in told.restarts if r.search]) <= math.ceil(math.log2(3)) + 2


def test_a_request_like_a_quarantined_one_is_answered_without_the_engine():
    engine, told = DyingEngine(poison="POISON"), Told()
    rows_ = rows(30, poisoned={3}, twins={20: 3})
    out = results(Supervisor(engine, 3, told), rows_, max_in_flight=2)
    assert "r20" not in engine.sent[engine.sent.index("r19") :]
    assert out["r20"]["error"].startswith(out["r3"]["error"]) and "'r3'" in out["r20"]["error"]
    assert [q[0] for q in told.quarantines] == ["r3"]


def test_past_engine_restarts_the_run_ends_and_says_why():
    engine, told = DyingEngine(poison="POISON"), Told()
    seen = []
    with pytest.raises(RuntimeFailure) as err:
        for row, _ in Supervisor(engine, 1, told).stream(iter(rows(10, poisoned=set(range(10)))), 2):
            seen.append(row.request_id)
    assert not isinstance(err.value, EngineDied)
    assert "execution.engine_restarts" in str(err.value) and "poisoned" in str(err.value)
    assert len(seen) == len(set(seen))
    assert len([r for r in told.restarts if not r.search]) == 1


def test_engine_restarts_1_cannot_quarantine_a_lone_killer_and_says_so():
    """A quarantine takes two deaths of the budget: with 1 the second death ends the run, and
    the message names the request and the setting that would have quarantined it."""
    engine = DyingEngine(poison="POISON")
    with pytest.raises(RuntimeFailure) as err:
        results(Supervisor(engine, 1), rows(6, poisoned={2}), max_in_flight=1)
    assert "'r2' was in flight at two deaths" in str(err.value)
    assert "at least 2 lets a run quarantine it" in str(err.value)
    told = Told()
    out = results(Supervisor(DyingEngine(poison="POISON"), 2, told), rows(6, poisoned={2}), max_in_flight=1)
    assert [q[0] for q in told.quarantines] == ["r2"] and len(out) == 6


def test_a_quarantined_score_pair_takes_no_other_pair_of_its_query():
    """The quarantine's key is the whole request: a cross-encoder row's pair included (it was
    its first text alone, so every later row of the same query became an error row)."""
    engine, told = DyingEngine(poison="POISON"), Told()
    pairs = [
        Row(shard="s", index=i, request_id=f"r{i}", kept={}, prompt="query q", pair=f"doc {i}")
        for i in range(6)
    ]
    pairs[1].pair = "doc 1 POISON"
    engine_rows = pairs
    out = results(Supervisor(engine, 3, told), engine_rows, max_in_flight=1)
    assert [q[0] for q in told.quarantines] == ["r1"]
    assert [r_id for r_id, r in out.items() if r["error"]] == ["r1"]


def test_engine_restarts_0_ends_the_run_at_the_first_death():
    engine = DyingEngine(deaths_after=[3])
    with pytest.raises(RuntimeFailure, match="engine_restarts"):
        results(Supervisor(engine, 0), rows(10))
    assert engine.starts == 1


def test_a_start_that_fails_is_one_more_restart():
    engine, told = DyingEngine(deaths_after=[4], failed_starts=1), Told()
    out = results(Supervisor(engine, 3, told), rows(12))
    assert len(out) == 12 and engine.starts == 3
    (restart,) = told.restarts
    assert restart.attempts == 2 and restart.restarts_left == 1


def test_a_stopping_run_restarts_nothing():
    engine = DyingEngine(deaths_after=[2])
    with pytest.raises(EngineDied):
        results(Supervisor(engine, 3), rows(10), stop=lambda: engine.finished >= 2)
    assert engine.starts == 1


def test_an_engine_that_cannot_restart_is_not_supervised():
    from helpers.fakes import FakeEngine

    assert supervise(FakeEngine(), 3) is None
    assert isinstance(supervise(DyingEngine(), 3), Supervisor)


def test_counters_of_a_replaced_engine_add_up():
    assert add_counters(
        {"spec_decode_num_drafts": 10, "spec_decode_num_accepted_tokens_per_pos": [5, 3]},
        {"spec_decode_num_drafts": 4, "spec_decode_num_accepted_tokens_per_pos": [2, 1, 1], "x": 1},
    ) == {"spec_decode_num_drafts": 14, "spec_decode_num_accepted_tokens_per_pos": [7, 4, 1], "x": 1}
    assert add_counters({}, {"a": 1}) == {"a": 1}


def test_an_engine_start_sets_the_heap_aside_and_a_failed_one_gives_it_back():
    import gc

    from batchspec.engine.llm import _start_with_the_heap_frozen

    gc.unfreeze()
    assert _start_with_the_heap_frozen(gc.get_freeze_count) > 0  # frozen while vLLM starts
    gc.unfreeze()  # (vLLM keeps its own start-up heap frozen until shutdown)

    def fails():
        raise RuntimeError("no engine")

    with pytest.raises(RuntimeError):
        _start_with_the_heap_frozen(fails)
    assert gc.get_freeze_count() == 0


def test_a_death_note_waits_for_the_exit_status_of_a_process_still_being_torn_down():
    """A killed EngineCore of a few GiB is seen gone before its status can be read (the busier
    the machine, the longer): the note waits for it and says which signal, not only "died"."""
    import threading
    from types import SimpleNamespace

    from batchspec.engine.supervise import death_note

    class Dying:  # multiprocessing.Process's exitcode: None until the status is read
        pid = 4242
        exitcode = None

    class Gone:  # psutil's view: the process no longer runs
        pid = 4242

        def is_running(self):
            return False

    dying = Dying()
    core = SimpleNamespace(resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[dying])))
    threading.Timer(0.3, lambda: setattr(dying, "exitcode", -9)).start()
    assert (
        death_note(core, [(Gone(), "VLLM::EngineCore")])
        == "VLLM::EngineCore (pid 4242) died, killed by SIGKILL"
    )
    dying.exitcode = None  # never read: the note still names the death, after the wait
    assert death_note(core, [(Gone(), "VLLM::EngineCore")]) == "VLLM::EngineCore (pid 4242) died"
