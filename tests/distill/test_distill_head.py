"""``batchspec distill --method eagle3``: an EAGLE-3 head trained on the job's own prompts.

Without an engine: the head in torch computes what vLLM's ``LlamaForCausalLMEagle3`` computes
(checked on the engine below, through acceptance), the features stream to chunk files and
training holds one chunk at a time, ``--max-minutes`` stops training, and every option a head
cannot use is refused (exit 2) before any work.

On the engine (about a minute and a half: generation, two evaluations): a random head, trained
on JSON-domain prompts of the tiny target, accepts more on held-out prompts than before, is
installed in speculators' format with its card, and loads in vLLM (the evaluation runs it)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from domain_data import write_shards
from helpers.jobs import ENGINE, MODELS, run_cli, run_cli_in_process, write_job

from batchspec.distill import eagle3
from batchspec.distill import features as features_mod
from batchspec.distill.options import DistillOptions
from batchspec.distill.session import check_options
from batchspec.errors import SpecError
from batchspec.spec.load import load_spec

pytestmark = pytest.mark.vllm


def _job(tmp: Path, rows: int = 48, secret: str | None = None) -> Path:
    write_shards(tmp / "prompts", rows=rows, shards=2, seed=5)
    return write_job(
        tmp / "job.yaml",
        input={"path": str(tmp / "prompts" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={
            "path": str(tmp / "run-out"),
            **({"storage_options": {"secret": "${HEAD_TEST_SECRET}"}} if secret else {}),
        },
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        speculative=None,
        sampling={"temperature": 0.0, "max_tokens": 32, "ignore_eos": True},
    )


@pytest.fixture
def random_head(tmp_path, models) -> Path:
    """An untrained head for the tiny target (what distill starts from without --head)."""
    config = eagle3.head_config(eagle3.target_config(str(MODELS / "target")), k=3)
    head = eagle3.new_head(str(MODELS / "target"), config, seed=3)
    eagle3.save_head(head, tmp_path / "random-head")
    return tmp_path / "random-head"


def _rows(n: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [1, *(rng.randrange(3, 2000) for _ in range(8))],
            "output_token_ids": [5] * length,
        }
        for _ in range(n)
    ]


def test_features_stream_in_chunks_and_training_holds_one_at_a_time(tmp_path, models, monkeypatch):
    features = features_mod.collect_features(
        str(MODELS / "target"), _rows(10, 20), [1, 2, 3], tmp_path / "f", chunk_rows=4
    )
    assert [p.name for p in features.files] == [f"features-{i:05d}.safetensors" for i in range(3)]
    assert features.sequences == 10 and features.tokens == 10 * 29
    chunk = eagle3._load_chunk(features.files[0])
    assert chunk["aux"].shape == (4, 29, 3 * 256) and str(chunk["aux"].dtype) == "torch.float16"
    # a restart with the same rows reuses the files; nothing is computed again
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", None)
    again = features_mod.collect_features(
        str(MODELS / "target"), _rows(10, 20), [1, 2, 3], tmp_path / "f", chunk_rows=4
    )
    assert again.files == features.files
    # training reads one chunk file at a time
    loads: list[Path] = []
    real = eagle3._load_chunk
    monkeypatch.setattr(eagle3, "_load_chunk", lambda p: (loads.append(p), real(p))[1])
    batches = eagle3._batches(features.files, 2, random.Random(0))
    for _ in range(5):  # one pass: 2 + 2 + 1 batches of the chunks of 4, 4 and 2 rows
        next(batches)
    assert sorted(loads) == features.files  # each chunk loaded once, while its batches were read
    next(batches)
    assert len(loads) == 4  # the next pass loads the next chunk only


def test_max_minutes_stops_training(tmp_path, random_head, models):
    head = eagle3.load_head(str(random_head), str(MODELS / "target"))
    files = features_mod.collect_features(
        str(MODELS / "target"), _rows(4, 12), [1, 2, 3], tmp_path / "f"
    ).files
    result = eagle3.train_head(head, files, files, 50, 1e-3, 2, 0, deadline=time.monotonic() - 1)
    assert result.stopped_by_time and result.steps == 0 and not result.stopped_early


@pytest.mark.parametrize(
    "changes, key, words",
    [
        ({"draft": str(MODELS / "draft")}, "--draft", "give the head to start from with --head"),
        ({"init": "target"}, "--init", "applies to draft models"),
        ({"logprobs": 4}, "--logprobs", "leave --logprobs out"),
        ({"head": str(MODELS / "draft")}, "--head", "is not an EAGLE-3 head"),
        ({"aux_layers": (1, 2, 4)}, "--aux-layers", "the target has 4 layers"),
        ({"aux_layers": (1, 2), "head": str(MODELS / "head")}, "--aux-layers", "its own auxiliary layers"),
        ({"max_minutes": 0}, "--max-minutes", "expected minutes > 0"),
    ],
)
def test_what_a_head_cannot_use_is_refused_before_any_work(tmp_path, models, changes, key, words):
    spec = load_spec(_job(tmp_path, rows=4))
    opts = DistillOptions(out=tmp_path / "new-head", method="eagle3", **changes)
    with pytest.raises(SpecError) as err:
        check_options(spec, opts)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_head_options_are_refused_for_a_draft_model(tmp_path, models):
    spec = load_spec(_job(tmp_path, rows=4))
    with pytest.raises(SpecError) as err:
        check_options(
            spec, DistillOptions(out=tmp_path / "d", draft=str(MODELS / "draft"), head=str(MODELS / "head"))
        )
    assert err.value.key == "--head"


@pytest.mark.engine
def test_distill_trains_a_head_that_accepts_more_and_loads_in_vllm(tmp_path, random_head, models):
    secret = "head-test-secret-91c2"
    job = _job(tmp_path, secret=secret)
    out = tmp_path / "head"
    result = run_cli(
        "distill",
        str(job),
        "--method",
        "eagle3",
        "--head",
        str(random_head),
        "--out",
        str(out),
        "--sample",
        "96",
        "--holdout",
        "16",
        "--steps",
        "80",
        "--batch-size",
        "8",
        "--k",
        "3",
        "--json",
        env={"HEAD_TEST_SECRET": secret},
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    before, after = figures["before"], figures["after"]
    assert figures["decision"]["install"] is True, figures["decision"]
    print(json.dumps(figures))  # the figures, for the log
    # the random head is measured (vLLM loads it) and accepts next to nothing; the trained one
    # accepts far more, at every position
    assert after["acceptance_rate"] >= before["acceptance_rate"] + 0.2, (before, after)
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"]
    assert len(after["acceptance_per_position"]) == 3 and after["acceptance_per_position"][0] > 0.3
    # speculators' format, which vLLM loaded as it is in the evaluation above
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir()) == [
        "batchspec-model.json",
        "config.json",
        "model.safetensors",
    ]
    card = json.loads((out / "batchspec-model.json").read_text())
    assert card["role"] == "head" and card["method"] == "eagle3"
    assert card["training"]["validation_metric"].startswith("held-out tokens right in a row")
    assert card["training"]["validation_agreement"] > card["training"]["start_validation_agreement"]
    for path in out.iterdir():
        assert secret not in path.read_bytes().decode("latin-1"), path
    assert card["job"]["spec"]["output"]["storage_options"] == {"secret": "***"}  # the public view
    # the installed head runs a job: its method comes from its config
    run = run_cli_in_process(
        "validate",
        str(job),
        "--set",
        f"speculative={{model: {out}, num_speculative_tokens: 3}}",
        env={"HEAD_TEST_SECRET": secret},
    )
    assert run.returncode == 0, run.stderr[-2000:]
