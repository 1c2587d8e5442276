"""``tune`` and ``speculative: auto`` with an EAGLE-3 head among the candidates: the head is
found to be one by its checkpoint's config (never its name), a head that does not fit the
target is refused before any work naming its key, and on the real engine auto measures the head
beside a draft model and speculation off, keeps greedy text equal, and records what the chosen
drafter is by content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers.jobs import MODELS, ROOT, run_cli

from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.tune.search_space import candidates

EXAMPLE = ROOT / "examples" / "auto-speculation" / "job.yaml"


def _raw(tmp_path: Path, speculative) -> dict:
    return {
        "name": "heads-tune",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": str(MODELS / "target")},
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


@pytest.mark.vllm
def test_tune_families_take_the_method_from_the_checkpoint(tmp_path, models):
    # the head under a draft's name and the draft under a head's name: each is what it is
    head = shutil.copytree(MODELS / "head", tmp_path / "draft-x")
    draft = shutil.copytree(MODELS / "draft", tmp_path / "eagle3-x")
    spec = build_spec(_raw(tmp_path, None))
    _, families = candidates(spec, [str(head), str(draft)], [1, 3], ngram=False)
    methods = {name: {c.speculative["method"] for c in fam} for name, fam in families.items()}
    assert methods == {"eagle3:draft-x": {"eagle3"}, "eagle3-x": {"draft_model"}}


@pytest.mark.vllm
def test_a_head_that_does_not_fit_is_refused_before_any_work(tmp_path, models):
    from batchspec.tune.auto import check_auto
    from batchspec.tune.session import check_candidate_models

    head = Path(shutil.copytree(MODELS / "head", tmp_path / "head"))
    config = json.loads((head / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 11]  # a 12-layer target's
    (head / "config.json").write_text(json.dumps(config))
    spec = build_spec(_raw(tmp_path, None))
    with pytest.raises(SpecError) as err:
        check_candidate_models(spec, [str(MODELS / "draft"), str(head)], "--draft")
    assert err.value.key == "--draft" and "it has 4" in str(err.value)
    auto = build_spec(_raw(tmp_path, {"method": "auto", "drafts": [str(MODELS / "draft"), str(head)]}))
    with pytest.raises(SpecError) as err:
        check_auto(auto)
    assert err.value.key == "speculative.drafts[1]"


@pytest.mark.engine
def test_auto_weighs_a_head_beside_a_draft_and_records_what_it_chose(tmp_path, models):
    """examples/auto-speculation/job.yaml as ``batchspec run`` runs it, with the tiny draft and
    the head to choose from: both measured at two k, greedy text equal to off for every
    candidate, and the chosen drafter (if any) named by method and content digests."""
    from demo_data import prompt_table

    (tmp_path / "in").mkdir()
    pq.write_table(prompt_table(8, seed=7400, max_tokens=(8, 24)), tmp_path / "in" / "day-0.parquet")
    env = {
        "BATCHSPEC_DEMO_INPUT": str(tmp_path / "in" / "*.parquet"),
        "BATCHSPEC_EXAMPLE_OUTPUT": str(tmp_path / "out"),
    }
    proc = run_cli(
        "run",
        str(EXAMPLE),
        "--set",
        f"model.target={MODELS / 'target'}",
        "--set",
        f"speculative.drafts=[{MODELS / 'draft'}, {MODELS / 'head'}]",
        "--set",
        "speculative.k=[1,3]",
        "--set",
        "speculative.ngram=false",
        "--set",
        "speculative.batch_knobs=false",  # the knob stage on the real engine: test_knobs.py
        "--log-format",
        "json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    finished = next(e for e in events if e["event"] == "run_finished")
    summary = json.loads(Path(finished["summary"]).read_text())
    record = json.loads(Path(summary["speculative_auto"]["record"]).read_text())
    measured = {
        c["label"]: c for c in record["measurements"]["candidates"] if c["output_tokens_per_s"] is not None
    }
    assert {"off", "draft k=1", "draft k=3", "eagle3:head k=1", "eagle3:head k=3"} <= set(measured), measured
    head = measured["eagle3:head k=3"]
    assert head["speculative"]["method"] == "eagle3"
    assert record["measurements"]["lossless"]["mismatches"] == []
    # the head's own acceptance was measured per position, as a draft's is
    assert head.get("acceptance_per_position"), head
    drafter = record["drafter"]
    if record["speculative"] is None or record["speculative"].get("model") is None:
        assert drafter is None
    else:  # the chosen head or draft by the digest of its weights
        import hashlib

        chosen = MODELS / ("head" if record["speculative"]["method"] == "eagle3" else "draft")
        digest = hashlib.sha256((chosen / "model.safetensors").read_bytes()).hexdigest()
        assert drafter["method"] == record["speculative"]["method"], drafter
        assert drafter["weights"] == {"model.safetensors": digest}, drafter
