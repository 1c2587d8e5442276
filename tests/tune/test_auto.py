"""``speculative: auto``: the run measures and chooses before its first shard, keeps the choice
under the output's ``_batchspec/auto/``, and reuses it until the model, a draft, the sampling
or the machine changes.

The bookkeeping on fake engines first (measuring with tune's stand-in engine, generating with
the runner's), then the example job on the real engine (tiny pair) as a user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from helpers.fakes import FakeEngine, FakeTuneEngine, use_fake_tune_engine
from helpers.jobs import MODELS, ROOT, run_cli, write_job, write_parquet

from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.spec.fingerprint import spec_fingerprint
from batchspec.spec.load import load_spec

# --------------------------------------------------------------------------- the spec


def _raw(speculative, **extra) -> dict:
    return {
        "input": {"path": "in/*.parquet", "prompt_column": "prompt"},
        "output": {"path": "out"},
        "model": {"target": "t"},
        "speculative": speculative,
        **extra,
    }


def test_auto_alone_tries_the_methods_that_need_no_draft():
    spec = build_spec(_raw("auto"))
    assert spec.speculative is None
    assert spec.speculative_auto.drafts == () and spec.speculative_auto.ngram


@pytest.mark.parametrize(
    "section, key",
    [
        ({"method": "auto", "draft": ["d"]}, "speculative.draft"),
        ({"method": "auto", "k": [0, 2]}, "speculative.k"),
        ({"method": "auto", "k": []}, "speculative.k"),
        ({"method": "auto", "drafts": "d"}, "speculative.drafts"),
        ({"method": "auto", "ngram": False}, "speculative.drafts"),
        ({"method": "auto", "max_minutes": 0}, "speculative.max_minutes"),
        ({"method": "auto", "concurrency": [16, -1]}, "speculative.concurrency"),
        ("fastest", "speculative"),
    ],
)
def test_a_bad_auto_section_names_its_key(section, key):
    with pytest.raises(SpecError) as err:
        build_spec(_raw(section))
    assert err.value.key == key


def test_auto_is_refused_on_ray_before_any_work():
    with pytest.raises(SpecError) as err:
        build_spec(_raw("auto", executor={"kind": "ray"}))
    assert err.value.key == "speculative" and "batchspec tune" in str(err.value)


def test_the_output_fingerprint_holds_auto_never_its_drafts_or_choice(tmp_path):
    (tmp_path / "d1").mkdir()
    (tmp_path / "d1" / "config.json").write_text("{}")
    a = spec_fingerprint(build_spec(_raw({"method": "auto", "drafts": [str(tmp_path / "d1")]})))
    b = spec_fingerprint(build_spec(_raw({"method": "auto", "drafts": ["other"], "k": [2]})))
    c = spec_fingerprint(
        build_spec(_raw({"method": "draft_model", "model": "other", "num_speculative_tokens": 2}))
    )
    assert a == b and "speculative.model" not in a
    assert a["speculative"] != c["speculative"]


# --------------------------------------------------------------------------- the run, faked


@pytest.fixture()
def auto_job(tmp_path, monkeypatch):
    """A job with speculative: auto over one draft; tune's stand-in engine measures (the draft
    4x faster than off), the runner's fake engine generates."""
    import batchspec.engine.checks
    import batchspec.engine.llm

    use_fake_tune_engine(monkeypatch)
    monkeypatch.setattr(batchspec.engine.checks, "check_vllm_keys", lambda spec: None)
    monkeypatch.setattr(FakeTuneEngine, "speedup", 4.0)
    monkeypatch.setattr(FakeTuneEngine, "started", [])
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"layers": 2}')
    _shard(tmp_path, 0)
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp_path / "out")},
        model={"target": "t"},
        speculative={
            "method": "auto",
            "drafts": [str(draft)],
            "k": [1, 2, 4],
            "ngram": False,
            "sample": 8,
            "concurrency": [4],
        },
        sampling={"temperature": 0.0, "max_tokens": 24},
    )
    return job


def _shard(tmp_path: Path, i: int, rows: int = 10) -> None:
    write_parquet(
        tmp_path / "in" / f"part-{i}.parquet",
        {"id": [f"p{i}-{r}" for r in range(rows)], "prompt": [f"prompt {i} {r}" for r in range(rows)]},
    )


def _run(job: Path, **kwargs):
    from helpers.shared_engines import run_library

    engine = FakeEngine()
    run = run_library(load_spec(job), engine, **kwargs)
    assert run.exit_code == 0, run.log
    return run, engine


def _records(tmp_path: Path) -> list[dict]:
    return [
        json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "_batchspec" / "auto").glob("*.json"))
    ]


@pytest.mark.vllm
def test_a_run_measures_once_then_reuses_its_choice(auto_job, tmp_path):
    first, engine = _run(auto_job)
    auto = first.summary["speculative_auto"]
    assert auto["reused"] is False and auto["chosen"].startswith("draft k=")
    measured = list(FakeTuneEngine.started)
    assert measured[0] is None and len(measured) >= 3  # off, then the draft's k=4 and k=1 ...
    # the run generated with the choice, and the shard says what ran
    assert engine.bound[-1].speculative == auto["speculative"]
    meta = json.loads(pq.read_schema(tmp_path / "out" / "part-0.parquet").metadata[b"batchspec"])
    assert meta["speculative_auto"] is True and meta["speculative_method"] == "draft_model"
    assert (
        meta["spec"]["speculative"]["num_speculative_tokens"] == auto["speculative"]["num_speculative_tokens"]
    )
    [record] = _records(tmp_path)
    assert record["chosen"] == auto["chosen"] and record["sample"]["rows"] == 8
    chosen = next(
        c
        for c in record["measurements"]["candidates"]
        if c["label"] == auto["chosen"] and c["concurrency"] == 4
    )
    # the pending rows' tokens (the fake writes 24 a row) at the chosen candidate's tok/s
    assert record["predicted"]["rows"] == 10
    assert record["predicted"]["wall_s"] == pytest.approx(10 * 24 / chosen["output_tokens_per_s"], abs=0.06)
    assert {c["label"] for c in record["measurements"]["candidates"]} >= {"off", "draft k=4"}
    assert first.events("speculative_auto_progress"), "measuring shows its progress"

    _shard(tmp_path, 1)  # tomorrow's rows: the same job, nothing changed
    FakeTuneEngine.started.clear()
    second, engine = _run(auto_job)
    assert FakeTuneEngine.started == [], "a stored choice is used without measuring"
    assert second.summary["speculative_auto"]["reused"] is True
    assert second.summary["speculative_auto"]["chosen"] == auto["chosen"]
    assert engine.bound[-1].speculative == auto["speculative"]
    assert second.summary["totals"]["rows"] == 10 and len(_records(tmp_path)) == 1


@pytest.mark.vllm
def test_a_changed_draft_sampling_machine_or_remeasure_measures_again(auto_job, tmp_path, monkeypatch):
    _run(auto_job)
    keys = {r["key"] for r in _records(tmp_path)}
    changes = [  # a draft changed is not a stale output (greedy text is the same); sampling is
        (
            "draft retrained in place",
            lambda: (tmp_path / "draft" / "config.json").write_text('{"layers": 3}'),
            False,
        ),
        ("sampling", lambda: _edit(auto_job, "sampling", {"temperature": 0.0, "max_tokens": 12}), True),
        (
            "machine",
            lambda: monkeypatch.setattr("batchspec.tune.auto.hardware", lambda: {"cpu": "another"}),
            False,
        ),
    ]
    for i, (what, change, overwrite) in enumerate(changes):
        change()
        _shard(tmp_path, 10 + i)
        FakeTuneEngine.started.clear()
        run, _ = _run(auto_job, overwrite=overwrite)
        assert FakeTuneEngine.started, f"{what}: measured again"
        assert run.summary["speculative_auto"]["reused"] is False
        keys.add(run.summary["speculative_auto"]["key"])
        assert len(keys) == i + 2, what
    # the same job and machine again, on request
    _shard(tmp_path, 20)
    FakeTuneEngine.started.clear()
    run, _ = _run(auto_job, remeasure=True)
    assert FakeTuneEngine.started and run.summary["speculative_auto"]["reused"] is False


def _edit(job: Path, key: str, value) -> None:
    raw = yaml.safe_load(job.read_text())
    raw[key] = value
    job.write_text(yaml.safe_dump(raw))


@pytest.mark.vllm
def test_off_is_chosen_where_no_candidate_beats_it(auto_job, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeTuneEngine, "speedup", 1.0)  # speculation only adds work here
    run, engine = _run(auto_job)
    assert run.summary["speculative_auto"]["chosen"] == "off"
    assert engine.bound[-1].speculative is None
    meta = json.loads(pq.read_schema(tmp_path / "out" / "part-0.parquet").metadata[b"batchspec"])
    assert meta["speculative_method"] is None and meta["speculative_auto"] is True
    _shard(tmp_path, 1)
    FakeTuneEngine.started.clear()
    run, engine = _run(auto_job)
    assert FakeTuneEngine.started == [] and engine.bound[-1].speculative is None


@pytest.mark.vllm
def test_a_lossy_candidate_is_never_chosen(auto_job, monkeypatch):
    monkeypatch.setattr(FakeTuneEngine, "lossy", True)
    run, engine = _run(auto_job)
    assert run.summary["speculative_auto"]["chosen"].startswith("off")
    assert engine.bound[-1].speculative is None


@pytest.mark.vllm
def test_the_record_holds_no_credential(tmp_path, monkeypatch):
    import batchspec.engine.checks
    import batchspec.engine.llm

    use_fake_tune_engine(monkeypatch)
    monkeypatch.setattr(batchspec.engine.checks, "check_vllm_keys", lambda spec: None)
    monkeypatch.setattr(FakeTuneEngine, "speedup", 4.0)
    monkeypatch.setenv("DRAFT_TOKEN", "tok-5ecret-99")
    _shard(tmp_path, 0)
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
                "output": {"path": str(tmp_path / "out")},
                "model": {"target": "t"},
                "speculative": {
                    "method": "auto",
                    "ngram": False,
                    "sample": 8,
                    "concurrency": [2],
                    "k": [2],
                    "drafts": ["https://user:${DRAFT_TOKEN}@models.example/draft?sig=s1gnature"],
                },
                "sampling": {"temperature": 0.0},
            }
        )
    )
    run, _ = _run(tmp_path / "job.yaml")
    assert run.summary["speculative_auto"]["chosen"] == "draft k=2"
    written = "".join(p.read_text() for p in (tmp_path / "out" / "_batchspec").rglob("*.json"))
    written += run.log
    for secret in ("tok-5ecret-99", "s1gnature", "user:"):
        assert secret not in written


@pytest.mark.vllm
def test_the_run_uses_the_batch_knobs_it_chose_and_a_reused_choice_reuses_them(
    auto_job, tmp_path, monkeypatch
):
    """The job's level is 4; 8 in flight runs rows twice as fast: the knob stage measures it for
    the chosen draft and the run goes with max_num_seqs = max_in_flight = 8, as the summary,
    the log and the shards' metadata say; the next run reuses the knobs with the choice."""
    monkeypatch.setattr(FakeTuneEngine, "batches", [])
    # the other token budgets clearly slower: equal speeds left the choice to timing noise
    monkeypatch.setattr(
        FakeTuneEngine,
        "knob_speed",
        staticmethod(lambda seqs, tokens, c: (2.0 if c >= 8 else 1.0) * (1.0 if tokens == 2048 else 0.6)),
    )
    run, engine = _run(auto_job)
    auto = run.summary["speculative_auto"]
    knobs = auto["batch_knobs"]
    assert knobs["set"] == {"model.engine": {"max_num_seqs": 8}, "execution": {"max_in_flight": 8}}
    assert knobs["chosen"] == {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_in_flight": 8}
    assert knobs["baseline"]["max_num_seqs"] == 4 and knobs["gain"] > knobs["noise"]
    assert knobs["decision"].startswith("run with max_num_seqs 8")
    # the knob stage's engines came last, for the chosen draft: 8 seqs, then the token budgets
    assert FakeTuneEngine.batches[-3:] == [(8, 2048), (8, 1024), (8, 4096)]
    assert FakeTuneEngine.started[-1] == auto["speculative"]
    bound = engine.bound[-1]
    assert bound.model.engine["max_num_seqs"] == 8 and bound.execution.max_in_flight == 8
    assert bound.speculative == auto["speculative"]
    [chose] = run.events("speculative_auto")
    assert "batch knobs: run with max_num_seqs 8" in chose["message"] and chose["batch_knobs"] == knobs["set"]
    meta = json.loads(pq.read_schema(tmp_path / "out" / "part-0.parquet").metadata[b"batchspec"])
    assert (
        meta["spec"]["model"]["engine"]["max_num_seqs"] == 8
        and meta["spec"]["execution"]["max_in_flight"] == 8
    )
    [record] = _records(tmp_path)
    assert record["version"] == 2 and record["batch_knobs"]["set"] == knobs["set"]
    assert record["batch_knobs"]["configurations"], "the knobs measured are in the record"

    _shard(tmp_path, 1)
    FakeTuneEngine.started.clear()
    again, engine = _run(auto_job)
    assert FakeTuneEngine.started == [] and again.summary["speculative_auto"]["reused"] is True
    assert again.summary["speculative_auto"]["batch_knobs"]["set"] == knobs["set"]
    assert (
        engine.bound[-1].model.engine["max_num_seqs"] == 8 and engine.bound[-1].execution.max_in_flight == 8
    )


@pytest.mark.vllm
def test_batch_knobs_false_runs_with_the_jobs_own_values(auto_job, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeTuneEngine, "batches", [])
    _edit_auto(auto_job, batch_knobs=False)
    run, engine = _run(auto_job)
    knobs = run.summary["speculative_auto"]["batch_knobs"]
    assert knobs["set"] == {} and "turned off" in knobs["decision"]
    assert {seqs for seqs, _ in FakeTuneEngine.batches} == {4}, "no engine for the knobs"
    assert "max_num_seqs" not in engine.bound[-1].model.engine
    assert engine.bound[-1].execution.max_in_flight == 512
    _edit_auto(auto_job, batch_knobs="no")
    with pytest.raises(SpecError) as err:
        load_spec(auto_job)
    assert err.value.key == "speculative.batch_knobs"


def test_remeasure_needs_an_auto_job(tmp_path):
    from helpers.fakes import run_fake_cli

    _shard(tmp_path, 0)
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
    )
    proc = run_fake_cli("run", str(job), "--remeasure")
    assert proc.returncode == 2 and "--remeasure" in proc.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the real engine

EXAMPLE = ROOT / "examples" / "auto-speculation" / "job.yaml"


@pytest.mark.engine
def test_the_auto_example_on_the_real_engine_reuses_its_choice_and_remeasures_a_new_draft(tmp_path, models):
    """examples/auto-speculation/job.yaml as ``batchspec run`` runs it, with a copy of the tiny
    draft: the first run measures and writes its choice, the next day's run reuses it without
    an engine for measuring, and a draft retrained in place is measured again. Every measured
    candidate's greedy text equals speculation off's."""
    from demo_data import prompt_table
    from safetensors.torch import load_file, save_file

    draft = tmp_path / "draft"
    shutil.copytree(MODELS / "draft", draft)
    (tmp_path / "in").mkdir()
    env = {
        "BATCHSPEC_DEMO_INPUT": str(tmp_path / "in" / "*.parquet"),
        "BATCHSPEC_EXAMPLE_OUTPUT": str(tmp_path / "out"),
    }
    sets = [
        "--set",
        f"model.target={MODELS / 'target'}",
        "--set",
        f"speculative.drafts=[{draft}]",
        "--set",
        "speculative.k=[2,4]",
        "--set",
        "speculative.ngram=false",
        "--set",
        "speculative.batch_knobs=false",  # the knob stage on the real engine: test_knobs.py
        "--log-format",
        "json",
    ]

    def day(i: int) -> tuple[dict, list[dict]]:
        pq.write_table(
            prompt_table(8, seed=7300 + i, first_id=100 * i, max_tokens=(8, 24)),
            tmp_path / "in" / f"day-{i}.parquet",
        )
        proc = run_cli("run", str(EXAMPLE), *sets, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
        finished = next(e for e in events if e["event"] == "run_finished")
        return json.loads(Path(finished["summary"]).read_text()), events

    first, events = day(0)
    auto = first["speculative_auto"]
    assert auto["reused"] is False
    assert any(e["event"] == "speculative_auto_measuring" for e in events)
    progress = [e["message"] for e in events if e["event"] == "speculative_auto_progress"]
    assert any("off" in m for m in progress) and any("k=4" in m for m in progress), progress
    record = json.loads(Path(auto["record"]).read_text())
    labels = {
        c["label"] for c in record["measurements"]["candidates"] if c["output_tokens_per_s"] is not None
    }
    assert {"off", "draft k=4", "draft k=2"} <= labels
    assert record["measurements"]["lossless"]["mismatches"] == []
    assert record["predicted"]["wall_s"] > 0 and record["sample"]["rows"] > 0

    second, events = day(1)
    assert second["speculative_auto"]["reused"] is True
    assert second["speculative_auto"]["chosen"] == auto["chosen"]
    assert not any(e["event"].startswith("speculative_auto_measuring") for e in events)
    assert second["totals"]["rows"] == 8

    weights = draft / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in sorted(tensors) if n.endswith("weight"))
    tensors[name] = tensors[name] * 1.01  # retrained in place: same names, sizes and config
    save_file(tensors, str(weights), metadata={"format": "pt"})
    third, events = day(2)
    assert third["speculative_auto"]["reused"] is False
    assert third["speculative_auto"]["key"] != auto["key"]
    assert any(e["event"] == "speculative_auto_measuring" for e in events)
    assert len(list((tmp_path / "out" / "_batchspec" / "auto").glob("*.json"))) == 2

    # what ran is in every shard's metadata; greedy text does not depend on the choice
    for i, summary in enumerate((first, second, third)):
        meta = json.loads(pq.read_schema(tmp_path / "out" / f"day-{i}.parquet").metadata[b"batchspec"])
        chosen = summary["speculative_auto"]["speculative"]
        assert meta["speculative_auto"] is True
        assert meta["speculative_method"] == (chosen or {}).get("method")
    rows = pq.read_table(tmp_path / "out" / "day-0.parquet").to_pylist()
    assert all(r["error"] is None and r["generated_text"] for r in rows)


def test_a_missing_draft_is_refused_before_any_work(tmp_path, monkeypatch):
    """Not measured as skipped: the job names a draft that is not there (exit 2, naming it)."""
    import batchspec.engine.checks

    monkeypatch.setattr(batchspec.engine.checks, "check_vllm_keys", lambda spec: None)
    _shard(tmp_path, 0)
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        model={"target": "t"},
        speculative={"method": "auto", "drafts": [str(tmp_path / "no-such-draft")]},
    )
    from helpers.shared_engines import NoEngine, run_library

    run = run_library(load_spec(job), NoEngine())
    assert run.exit_code == 2 and "speculative.drafts[0]" in str(run.error)
    assert "no such directory" in str(run.error)
    assert not (tmp_path / "out" / "_batchspec" / "auto").exists()


@pytest.mark.vllm
def test_a_choice_made_without_measuring_anything_is_not_kept(auto_job, tmp_path):
    """Out of time before speculation off was measured: the run goes on with off and the next
    run measures, instead of reusing an off nobody measured."""
    _edit_auto(auto_job, max_minutes=1e-6)
    run, engine = _run(auto_job)
    auto = run.summary["speculative_auto"]
    assert auto["chosen"].startswith("off") and engine.bound[-1].speculative is None
    assert "not kept" in auto["record"] and _records(tmp_path) == []
    _edit_auto(auto_job, max_minutes=10)
    _shard(tmp_path, 1)
    FakeTuneEngine.started.clear()
    run, _ = _run(auto_job)
    assert FakeTuneEngine.started and run.summary["speculative_auto"]["reused"] is False
    assert len(_records(tmp_path)) == 1


def _edit_auto(job: Path, **values) -> None:
    raw = yaml.safe_load(job.read_text())
    raw["speculative"].update(values)
    job.write_text(yaml.safe_dump(raw))


def _edited(record: dict, edit: str):
    """The first run's record as a user (or a torn sync) might leave it."""
    if edit == "only chosen: null":
        return {"chosen": None}
    if edit == "chosen: null":
        return {**record, "chosen": None, "speculative": None}
    if edit == "a list":
        return []
    if edit == "a label outside the job":
        return {**record, "chosen": "draft k=9", "recommended": {"4": "draft k=9"}}
    if edit == "recommended mistyped":
        return {**record, "recommended": {"four": "off"}}
    if edit == "a label that is a list":
        return {**record, "recommended": {"4": [record["chosen"]]}}
    if edit == "chosen not what recommended gives":
        return {**record, "chosen": "off"}
    if edit == "batch knobs mistyped":
        return {
            **record,
            "batch_knobs": {**record["batch_knobs"], "set": {"model.engine": {"max_num_seqs": "8"}}},
        }
    if edit == "batch knobs missing":
        return {k: v for k, v in record.items() if k != "batch_knobs"}
    if edit == "no measured_at":
        return {k: v for k, v in record.items() if k != "measured_at"}
    raise AssertionError(edit)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "edit, why",
    [
        ("only chosen: null", "version"),
        ("chosen: null", "chosen"),
        ("a list", "not a JSON object"),
        ("a label outside the job", "draft k=9"),
        ("recommended mistyped", "recommended"),
        ("a label that is a list", "recommended"),
        ("chosen not what recommended gives", "chosen"),
        ("no measured_at", "measured_at"),
        ("batch knobs mistyped", "batch_knobs.set.model.engine"),
        ("batch knobs missing", "batch_knobs.set"),
    ],
)
def test_a_record_of_the_wrong_shape_is_measured_again_saying_why(auto_job, tmp_path, edit, why):
    """An edited ``_batchspec/auto/`` record is no record: the run measures again, a warning
    names the record and what was wrong with it, and the summary, the log and the shards'
    metadata say what ran (never a label the job cannot run)."""
    first, _ = _run(auto_job)
    path = Path(first.summary["speculative_auto"]["record"])
    path.write_text(json.dumps(_edited(json.loads(path.read_text()), edit)))
    _shard(tmp_path, 1)
    FakeTuneEngine.started.clear()
    run, engine = _run(auto_job)
    assert FakeTuneEngine.started, "measured again"
    [warning] = run.events("speculative_auto_record_ignored")
    assert warning["level"] == "warning" and warning["record"] == str(path)
    assert str(path) in warning["message"] and why in warning["message"]
    auto = run.summary["speculative_auto"]
    assert auto["reused"] is False and auto["chosen"].startswith("draft k=")
    assert engine.bound[-1].speculative == auto["speculative"]
    [chose] = run.events("speculative_auto")
    assert chose["chosen"] == auto["chosen"] and chose["reused"] is False
    meta = json.loads(pq.read_schema(tmp_path / "out" / "part-1.parquet").metadata[b"batchspec"])
    assert meta["speculative_method"] == auto["speculative"]["method"]
    assert (
        meta["spec"]["speculative"]["num_speculative_tokens"] == auto["speculative"]["num_speculative_tokens"]
    )
    # the record written again is whole: the next run reuses it, and says nothing more
    _shard(tmp_path, 2)
    FakeTuneEngine.started.clear()
    again, engine = _run(auto_job)
    assert FakeTuneEngine.started == [] and again.summary["speculative_auto"]["reused"] is True
    assert not again.events("speculative_auto_record_ignored")
    assert engine.bound[-1].speculative == again.summary["speculative_auto"]["speculative"]
