"""batchspec distill: the vocabulary check (before any engine), the training batch layout, and a
small distillation end to end on the real engine (tiny pair, JSON-domain prompts): the card,
acceptance before and after, and a restart that reuses the generated data.

Engine time: about 2 minutes (four engine starts: generation, two evaluations, one restart).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import DRAFT, run_cli, write_job
from domain_data import write_shards

from batchspec.distill_data import topk_lists
from batchspec.distill_train import _batch, prepare_examples

K = 2


def _job(tmp: Path, models: Path, rows: int = 60) -> Path:
    write_shards(tmp / "prompts", rows=rows, shards=2, seed=3)
    return write_job(tmp / "job.yaml",
                     input={"path": str(tmp / "prompts" / "*.parquet"), "prompt_column": "prompt",
                            "id_column": "id"},
                     output={"path": str(tmp / "run-out")},
                     speculative={**DRAFT, "num_speculative_tokens": K},
                     sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True})


def _bad_draft(tmp: Path, models: Path, what: str) -> Path:
    """A copy of the tiny draft whose tokenizer (or config) differs from the target's."""
    bad = tmp / f"draft-{what}"
    shutil.copytree(models / "draft", bad)
    if what == "tokenizer":
        tok = json.loads((bad / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = (next(t for t, i in vocab.items() if i == n) for n in (1000, 1001))
        vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens, two of them with other ids
        (bad / "tokenizer.json").write_text(json.dumps(tok))
    else:
        config = json.loads((bad / "config.json").read_text())
        config["vocab_size"] = 4096
        (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("what", ["tokenizer", "vocab_size"])
def test_a_draft_with_another_vocabulary_exits_2_before_any_engine(tmp_path, models, what):
    job = _job(tmp_path, models, rows=8)
    out = tmp_path / "new-draft"
    done = run_cli("distill", str(job), "--draft", str(_bad_draft(tmp_path, models, what)),
                   "--out", str(out), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "bad job spec" in done.stderr and "--draft" in done.stderr
    assert ("different tokenizers" if what == "tokenizer" else "vocabulary sizes") in done.stderr
    # refused before any work: no engine log, nothing generated, no output directory
    assert "vLLM's own output" not in done.stderr
    assert not out.exists()
    assert done.stdout == ""


def test_training_batch_predicts_the_continuation_only():
    examples = [{"prompt_token_ids": [5, 6, 7], "output_token_ids": [8, 9],
                 "topk_token_ids": [[8, 3], [9, 4]], "topk_logprobs": [[-0.1, -2.5], [-0.2, -1.9]]},
                {"prompt_token_ids": [5], "output_token_ids": [10, 11, 12],
                 "topk_token_ids": None, "topk_logprobs": None}]
    ids, mask, labels, teacher = _batch(prepare_examples(examples), [0, 1], pad_id=0, topk=True)
    # inputs are prompt + continuation less its last token; labels are the next tokens, where
    # the next token is the target's
    assert ids.tolist() == [[5, 6, 7, 8], [5, 10, 11, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[-100, -100, 8, 9], [10, 11, 12, -100]]
    t_ids, t_prob = teacher
    assert t_ids[0, 2].tolist() == [8, 3] and t_ids[0, 3].tolist() == [9, 4]
    assert abs(t_prob[0, 2].sum().item() - 1) < 1e-6 and t_prob[0, 2, 0] > t_prob[0, 2, 1]
    assert t_prob[1].sum().item() == 0  # no top-K kept for that row: no KL term there


def test_topk_lists_most_likely_first():
    class LP:
        def __init__(self, v):
            self.logprob = v

    ids, values = topk_lists([{4: LP(-3.0), 7: LP(-0.5), 1: LP(-1.0)}])
    assert ids == [[7, 1, 4]] and values == [[-0.5, -1.0, -3.0]]


# --------------------------------------------------------------------------- real engine


@dataclass
class Distilled:
    tmp: Path
    job: Path
    out: Path
    first: object
    result: dict
    card: dict


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, models) -> Distilled:
    tmp = tmp_path_factory.mktemp("distill")
    job = _job(tmp, models)
    out = tmp / "new-draft"
    done = run_cli("distill", str(job), "--draft", str(models / "draft"), "--out", str(out),
                   "--sample", "48", "--holdout", "12", "--steps", "30", "--batch-size", "8",
                   "--logprobs", "4", "--chunk-rows", "16", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads((out / "batchspec-model.json").read_text())
    return Distilled(tmp, job, out, done, json.loads(done.stdout), card)


@pytest.mark.engine
def test_distill_measures_acceptance_before_and_after(distilled, models):
    result = distilled.result
    assert set(result) == {"before", "after", "out"} and result["out"] == str(distilled.out)
    for side in ("before", "after"):
        m = result[side]
        assert 0 <= m["acceptance_rate"] <= 1
        assert 1 <= m["mean_acceptance_length"] <= K + 1
        assert len(m["acceptance_per_position"]) == K
        assert m["output_tokens_per_s"] > 0 and m["prompts"] == 12
    assert result["before"]["draft"] == str(models / "draft")
    assert result["after"]["draft"] == str(distilled.out)
    # the new weights are other weights, and vLLM loaded them as the draft (it measured them)
    assert result["before"]["acceptance_rate"] != result["after"]["acceptance_rate"]
    assert "train step 30/30: loss" in distilled.first.stderr and "top-1 agreement" in \
        distilled.first.stderr


@pytest.mark.engine
def test_card_and_model_directory(distilled, models):
    card, out = distilled.card, distilled.out
    assert card["parent_draft"] == str(models / "draft")
    assert card["target"] == str(models / "target")
    assert card["job"]["name"] == "job" and card["sample_size"] == 36 and card["heldout_size"] == 12
    assert card["steps"] == 30 and card["logprobs"] == 4
    assert card["data_fingerprint"].startswith("sha256:")
    assert card["acceptance"]["before"] == distilled.result["before"]
    assert card["acceptance"]["after"] == distilled.result["after"]
    assert card["generation"] == {**card["generation"], "generated_rows": 36, "reused_rows": 0}
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    assert (out / "tokenizer.json").read_bytes() == (models / "target" / "tokenizer.json").read_bytes()
    # the top-K was kept for every generated token
    chunks = sorted(out.glob("_work/generated-*/part-*.parquet"))
    assert len(chunks) == 3  # 36 rows in chunks of 16
    rows = pq.read_table(chunks[0]).to_pylist()
    assert all(len(r["topk_token_ids"]) == len(r["output_token_ids"]) == 24 for r in rows)
    assert all(r["topk_token_ids"][0][0] == r["output_token_ids"][0] for r in rows)  # greedy


@pytest.mark.engine
def test_a_restart_reuses_the_generated_data(distilled):
    chunks = sorted(distilled.out.glob("_work/generated-*/part-*.parquet"))
    kept = {p: p.stat().st_mtime_ns for p in chunks[:-1]}
    lost = pq.read_metadata(chunks[-1]).num_rows
    chunks[-1].unlink()  # as if the run had been killed before committing its last chunk
    done = run_cli("distill", str(distilled.job), "--draft", str(distilled.out.parent / "x"),
                   "--init", "target", "--layers", "1", "--out", str(distilled.out),
                   "--sample", "48", "--holdout", "12", "--steps", "2", "--batch-size", "8",
                   "--logprobs", "4", "--chunk-rows", "16", "--no-eval")
    assert done.returncode == 2, done.stderr  # a --draft that does not exist: refused first
    done = run_cli("distill", str(distilled.job), "--init", "target", "--layers", "1",
                   "--out", str(distilled.out), "--sample", "48", "--holdout", "12", "--steps", "2",
                   "--batch-size", "8", "--logprobs", "4", "--chunk-rows", "16", "--no-eval", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads((distilled.out / "batchspec-model.json").read_text())
    assert card["generation"]["generated_rows"] == lost
    assert card["generation"]["reused_rows"] == 36 - lost
    assert f"generating the target's continuations of {lost} prompts" in done.stderr
    assert all(p.stat().st_mtime_ns == m for p, m in kept.items())  # never rewritten
    assert card["data_fingerprint"] == distilled.card["data_fingerprint"]  # the same data
    assert card["init"] == "target" and card["parent_draft"] is None and card["layers"] == 1
    assert json.loads(done.stdout) == {"before": None, "after": None, "out": str(distilled.out)}
