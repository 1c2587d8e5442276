"""tune's batch-knob stage (batchspec/tune/knobs.py): the coordinate search and its noise rule
with a stand-in for the engine's timing, then through ``run_tune``, ``--json``, the table,
``--write`` and the command line on tune's fake engine; ``speculative: auto``'s side of it is in
test_auto.py. No vLLM engine starts here; the one real-engine tune of the knobs is at the end."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from helpers.fakes import FakeTuneEngine, use_fake_tune_engine
from helpers.jobs import ENGINE, MODELS, run_cli, write_job, write_parquet

from batchspec.errors import SpecError
from batchspec.tune.knobs import (
    TURNED_OFF,
    KnobConfig,
    KnobStage,
    passes_for,
    seq_values,
    token_values,
)
from batchspec.tune.model import TIME_BUDGET, LevelMeasurement, TuneOptions
from batchspec.tune.render import render_table

# --------------------------------------------------------------------------- the search


def test_the_values_measured_around_a_level_and_a_token_budget(monkeypatch):
    import batchspec.tune.knobs

    monkeypatch.setattr(batchspec.tune.knobs, "MIN_LEVEL_SECONDS", 4.0)  # users' level, not the suite's
    assert seq_values(4) == [2, 4, 8] and seq_values(1) == [1, 2] and seq_values(3) == [1, 3, 6]
    assert token_values(2048) == [1024, 4096] and token_values(1) == [2]
    assert passes_for(16, None) == 1 and passes_for(16, 10.0) == 1
    assert passes_for(8, 0.01) == 8  # 0.08 s a pass: as many as tune's levels allow


class Timings:
    """Stands in for one engine's timing: tok/s from (engine max_num_seqs, max_num_batched_tokens
    as vLLM resolves it, requests in flight); every call recorded."""

    def __init__(self, rate, default_tokens=2048, refuse=()):
        self.rate, self.default_tokens, self.refuse = rate, default_tokens, set(refuse)
        self.engines: list[tuple[int, int | None, list[int]]] = []

    def spec(self, max_num_seqs, tokens):
        if tokens in self.refuse:
            raise SpecError(
                "model", f"vLLM refused the engine configuration: max_num_batched_tokens {tokens}"
            )
        return (max_num_seqs, tokens)

    def measure(self, spec, levels, sizes, resolved):
        cap, tokens = spec
        tokens = tokens or self.default_tokens
        resolved.update(max_num_seqs=cap, max_num_batched_tokens=tokens)
        self.engines.append((cap, tokens, list(levels)))
        out = {}
        for c in levels:
            rows, passes = sizes[c]
            tps = self.rate(cap, tokens, c)
            out[c] = LevelMeasurement(c, rows, passes, [tps, tps], [1.0 / tps, 1.0 / tps], [1.0, 1.0])
        return out, {}


def _stage(timings, level=4, noise=0.05, deadline=None, job=None, objective="throughput"):
    return KnobStage(
        label="draft k=2",
        concurrency=level,
        noise=noise,
        objective=objective,
        make_spec=timings.spec,
        measure=timings.measure,
        rows=32,
        passes=2,
        deadline=deadline,
        job_values=job or {},
    )


def test_each_step_is_kept_only_where_it_beats_the_noise():
    """max_num_seqs 8 is 10% faster than the job's 4 (noise 5%): kept. Then, at 8, twice the
    token budget is 1% faster (within the noise: not kept) and half of it slower. Three engines:
    one for every max_num_seqs (its cap the largest), one per token budget."""

    def rate(cap, tokens, c):
        return {2: 80.0, 4: 100.0, 8: 110.0}[c] * {1024: 0.95, 2048: 1.0, 4096: 1.01}[tokens]

    timings = Timings(rate)
    report = _stage(timings).run()
    assert timings.engines == [(8, 2048, [2, 4, 8]), (8, 1024, [8]), (8, 4096, [8])]
    assert report.baseline == KnobConfig(4, 2048, 4)
    assert report.chosen == KnobConfig(8, 2048, 8) and report.gain == pytest.approx(0.10)
    assert report.sources == {
        "max_num_seqs": "tune level",
        "max_num_batched_tokens": "vLLM default",
        "max_in_flight": "tune level",
    }
    data = report.as_dict()
    by = {(c["max_num_seqs"], c["max_num_batched_tokens"]): c for c in data["configurations"]}
    assert by[(4, 2048)]["axis"] == "baseline" and by[(4, 2048)]["gain"] is None
    assert by[(8, 2048)]["compared_with"] == KnobConfig(4, 2048, 4).as_dict()
    assert by[(8, 2048)]["beats_noise"] is True and by[(2, 2048)]["beats_noise"] is False
    assert by[(8, 4096)]["compared_with"] == KnobConfig(8, 2048, 8).as_dict()
    assert by[(8, 4096)]["gain"] == pytest.approx(0.01) and by[(8, 4096)]["beats_noise"] is False
    assert by[(8, 2048)]["engine_max_num_seqs"] == 8 and by[(8, 4096)]["engine"] == 3
    assert data["chosen"] == {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_in_flight": 8}
    assert report.settings() == {"model.engine": {"max_num_seqs": 8}, "execution": {"max_in_flight": 8}}
    assert report.decision.startswith("run with max_num_seqs 8, max_num_batched_tokens 2048")
    assert "+10.0% tok/s" in report.decision


def test_nothing_within_the_noise_keeps_the_jobs_values_and_says_so():
    """Gains of 3% with a noise of 5%: the job's own values stay (its max_num_batched_tokens,
    measured around), and the decision names the best it measured."""
    timings = Timings(
        lambda cap, tokens, c: 100.0 * (1.03 if c == 8 else 1) * (1.03 if tokens == 1024 else 1)
    )
    report = _stage(timings, job={"max_num_seqs": 4, "max_num_batched_tokens": 2048}).run()
    assert report.chosen is None and report.settings() == {}
    assert report.sources["max_num_seqs"] == "job" and report.sources["max_num_batched_tokens"] == "job"
    assert timings.engines[0] == (8, 2048, [2, 4, 8])  # the job's value, measured around
    assert [e[1] for e in timings.engines[1:]] == [1024, 4096]
    assert report.decision.startswith("keep the job's max_num_seqs 4, max_num_batched_tokens 2048")
    assert "noise 5.0%" in report.decision and "+3.0%" in report.decision
    # the same gains above a 2% noise are kept, both steps
    report = _stage(Timings(timings.rate), noise=0.02).run()
    assert report.chosen == KnobConfig(8, 1024, 8) and report.gain == pytest.approx(0.0609)
    assert report.settings()["model.engine"] == {"max_num_seqs": 8, "max_num_batched_tokens": 1024}


def test_latency_objective_compares_e2e_p50():
    # tok/s grows with the batch but so does e2e p50 here: by latency the smaller batch wins
    timings = Timings(lambda cap, tokens, c: 100.0 / c)
    report = _stage(timings, objective="latency").run()
    assert report.chosen is not None and report.chosen.max_num_seqs == 2


def test_the_deadline_and_a_refused_configuration_are_skipped_with_the_reason():
    timings = Timings(lambda cap, tokens, c: 100.0)
    report = _stage(timings, deadline=time.monotonic() - 1).run()
    assert timings.engines == [] and report.chosen is None
    assert {r.skipped for r in report.results} == {TIME_BUDGET}
    assert "baseline was not measured" in report.decision

    timings = Timings(lambda cap, tokens, c: 100.0 * (2 if tokens == 1024 else 1), refuse={1024})
    report = _stage(timings).run()
    skipped = {r.config.max_num_batched_tokens: r.skipped for r in report.results if r.skipped}
    assert list(skipped) == [1024] and "vLLM refused" in skipped[1024]
    assert len(timings.engines) == 2 and report.chosen is None


# --------------------------------------------------------------------------- through run_tune, faked


@pytest.fixture()
def knob_job(tmp_path, monkeypatch):
    """A job without speculation on tune's fake engine, timed quickly, whose rows run 1.5x faster
    at 8 in flight than at 4 (the job's level) and 1.5x faster again with a 4096-token budget."""
    import batchspec.engine.llm
    import batchspec.tune.knobs
    import batchspec.tune.measure

    use_fake_tune_engine(monkeypatch)
    monkeypatch.setattr(batchspec.tune.measure, "MIN_LEVEL_SECONDS", 0.05)
    monkeypatch.setattr(batchspec.tune.knobs, "MIN_LEVEL_SECONDS", 0.05)
    monkeypatch.setattr(FakeTuneEngine, "started", [])
    monkeypatch.setattr(FakeTuneEngine, "batches", [])
    monkeypatch.setattr(
        FakeTuneEngine,
        "knob_speed",
        staticmethod(lambda seqs, tokens, c: (1.5 if c >= 8 else 1.0) * (1.5 if tokens >= 4096 else 1.0)),
    )
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"id": [f"a{i}" for i in range(40)], "prompt": [f"prompt {i}" for i in range(40)]},
    )
    return write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp_path / "out")},
        model={"target": "t", "engine": {"max_num_seqs": 4, "hf_token": "${HF_TOKEN}"}},
        execution={"max_in_flight": 4},
        sampling={"temperature": 0.0, "max_tokens": 24},
    )


@pytest.mark.vllm
def test_tune_measures_the_knobs_for_its_recommendation_and_writes_the_choice(
    knob_job, monkeypatch, tmp_path
):
    from batchspec.spec.load import load_spec
    from batchspec.tune.session import run_tune
    from batchspec.tune.written import written_spec

    monkeypatch.setenv("HF_TOKEN", "hf_FROMtheENVIRONMENT_4242")
    report = run_tune(load_spec(knob_job), TuneOptions(sample=40, ngram=False))
    # off (the job's level, 4), then the knob stage: max_num_seqs 8 for 2, 4, 8 in flight, then
    # the token budgets at 8
    assert FakeTuneEngine.batches == [(4, 2048), (8, 2048), (8, 1024), (8, 4096)]
    data = json.loads(json.dumps(report.as_dict()))
    knobs = data["batch_knobs"]
    assert knobs["speculative"] == "off" and knobs["concurrency"] == 4 and knobs["skipped"] is None
    assert knobs["baseline"] == {"max_num_seqs": 4, "max_num_batched_tokens": 2048, "max_in_flight": 4}
    assert (
        knobs["sources"]["max_num_seqs"] == "job" and knobs["vllm_resolved"]["max_num_batched_tokens"] == 2048
    )
    assert knobs["noise"] == data["noise"]["4"]["threshold"]
    assert knobs["chosen"] == {"max_num_seqs": 8, "max_num_batched_tokens": 4096, "max_in_flight": 8}
    assert knobs["gain"] > 1.0  # 2.25x, less the timing's overheads
    for c in knobs["configurations"]:
        assert {"output_tokens_per_s", "e2e_p50_s", "compared_with", "gain", "repeats", "rows"} <= set(c)
        assert c["rows"] == 32 and len(c["repeats"]) == 2  # the same rows; repeats as off
    table = render_table(report)
    assert (
        "batch knobs for off at concurrency 4 (gain:" in table
        and "batch knobs: run with max_num_seqs 8" in table
    )

    text = written_spec(str(knob_job), (), report, 4)
    written = yaml.safe_load(text)
    assert written["model"]["engine"] == {
        "max_num_seqs": 8,
        "hf_token": "${HF_TOKEN}",
        "max_num_batched_tokens": 4096,
    }
    assert written["execution"] == {"max_in_flight": 8}
    assert "# Batch knobs: run with max_num_seqs 8" in text and "hf_FROMtheENVIRONMENT" not in text


@pytest.mark.vllm
def test_no_batch_knobs_starts_no_engine_for_them_and_the_cli_says_so(knob_job, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from batchspec.cli.tune import tune

    monkeypatch.setenv("HF_TOKEN", "x")
    monkeypatch.setattr("batchspec.engine.checks.check_vllm_keys", lambda spec: None)
    out = tmp_path / "tuned.yaml"
    args = [
        str(knob_job),
        "--sample",
        "8",
        "--no-ngram",
        "--json",
        "--write",
        str(out),
        "-v",
        "--no-progress",
    ]
    result = CliRunner().invoke(tune, [*args, "--no-batch-knobs"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert FakeTuneEngine.batches == [(4, 2048)]
    knobs = json.loads(result.stdout[result.stdout.index("{") :])["batch_knobs"]
    assert knobs["skipped"] == TURNED_OFF and knobs["chosen"] is None and knobs["configurations"] == []
    written = yaml.safe_load(out.read_text())
    assert written["model"]["engine"]["max_num_seqs"] == 4 and written["execution"] == {"max_in_flight": 4}
    assert f"# Batch knobs: the job's batch values are kept: {TURNED_OFF}." in out.read_text()
    bad = CliRunner().invoke(tune, [*args, "--batch-knobs=maybe"])
    assert bad.exit_code == 2


# --------------------------------------------------------------------------- the real engine


@pytest.mark.engine
def test_tune_measures_the_knobs_on_the_tiny_target(tmp_path, models):
    """The tiny target without speculation, 16 rows at 2 in flight: off, then the knob stage's
    engines (max_num_seqs 4 timing 1, 2 and 4 in flight; vLLM's own max_num_batched_tokens read
    from the engine, halved and doubled), and a choice in ``--json``."""
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {"id": [f"a{i}" for i in range(16)], "prompt": [f"Tell me about the number {i}." for i in range(16)]},
    )
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp_path / "out")},
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        execution={"max_in_flight": 2},
        sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
    )
    result = run_cli("tune", str(job), "--sample", "16", "--no-ngram", "--repeats", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    knobs = json.loads(result.stdout)["batch_knobs"]
    assert knobs["skipped"] is None and knobs["speculative"] == "off" and knobs["concurrency"] == 2
    default = knobs["vllm_resolved"]["max_num_batched_tokens"]
    assert isinstance(default, int) and default > 0
    assert knobs["baseline"] == {"max_num_seqs": 2, "max_num_batched_tokens": default, "max_in_flight": 2}
    configs = {(c["max_num_seqs"], c["max_num_batched_tokens"]): c for c in knobs["configurations"]}
    for n in (1, 2, 4):
        assert configs[(n, default)]["output_tokens_per_s"] > 0, configs
    n = knobs["chosen"]["max_num_seqs"] if knobs["chosen"] else 2
    assert {(n, default // 2), (n, default * 2)} <= set(configs)
    if knobs["chosen"] is not None:
        assert knobs["gain"] > knobs["noise"] and knobs["decision"].startswith("run with")
    else:
        assert knobs["decision"].startswith("keep the job's")
    assert "batch knobs" in result.stderr  # a progress line per knob engine
