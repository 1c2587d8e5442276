"""EAGLE-3 heads before any weights load: what a checkpoint is (its config, never its name), the
checks that a head fits the target (exit 2 naming the key), ``method: suffix`` without its
package, and a head retrained in place as a changed spec. The head is the one `make models`
trains (``batchspec distill --method eagle3``); copies of it are bent for each refusal. Running
heads on the engine: tests/cli/test_e2e.py (columns, greedy equal to off),
tests/engine/test_cpu_sampling.py (sampled and seeded), tests/engine/test_requests.py
(structured outputs, logprobs) and tests/distill/test_distill_head.py (training)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers.jobs import HEAD, MODELS, run_cli_in_process, write_job

from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.spec.checkpoints import checkpoint_method, method_of

pytestmark = pytest.mark.vllm


def _spec(tmp_path: Path, speculative) -> dict:
    return {
        "name": "heads",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": str(MODELS / "target"), "engine": {"max_model_len": 512, "dtype": "float32"}},
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


def _check(tmp_path: Path, speculative: dict) -> None:
    from batchspec.engine.checks import check_vllm_keys

    check_vllm_keys(build_spec(_spec(tmp_path, speculative)))


@pytest.fixture
def head_copy(tmp_path, models) -> Path:
    """A copy of the built head whose config a test may bend."""
    return Path(shutil.copytree(MODELS / "head", tmp_path / "copy"))


def _bend(head: Path, **changes) -> Path:
    config = json.loads((head / "config.json").read_text())
    layer = config["transformer_layer_config"]
    for key, value in changes.items():
        (layer if key in layer and key not in config else config)[key] = value
    (head / "config.json").write_text(json.dumps(config))
    return head


def test_the_method_comes_from_the_checkpoint_never_its_name(tmp_path, models):
    assert method_of(str(MODELS / "head")) == "eagle3"
    assert method_of(str(MODELS / "draft")) == "draft_model"
    # a draft model in a directory named like a head is still a draft model, and the reverse
    named = shutil.copytree(MODELS / "draft", tmp_path / "eagle3-head")
    assert method_of(str(named)) == "draft_model"
    plain = shutil.copytree(MODELS / "head", tmp_path / "draft")
    assert method_of(str(plain)) == "eagle3"
    # vLLM's own formats: an Eagle3 architecture, an EAGLE-1 one
    assert checkpoint_method({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    assert checkpoint_method({"architectures": ["EagleLlamaForCausalLM"]}) == "eagle"
    assert checkpoint_method({"speculators_model_type": "peagle"}) == "peagle"  # a parallel head
    assert method_of("org/some-hub-id") == "draft_model"  # not readable before vLLM
    # the shorthand: a model and no method gets the checkpoint's method
    spec = build_spec(_spec(tmp_path, {"model": str(plain), "num_speculative_tokens": 3}))
    assert spec.speculative["method"] == "eagle3"
    spec = build_spec(_spec(tmp_path, {"model": str(named), "num_speculative_tokens": 3}))
    assert spec.speculative["method"] == "draft_model"


def test_the_built_head_fits_the_target(tmp_path, models):
    _check(tmp_path, HEAD)
    # and the shorthand form of it
    _check(tmp_path, {"model": HEAD["model"], "num_speculative_tokens": 2})


@pytest.mark.parametrize(
    "changes, key, words",
    [
        ({"hidden_size": 128}, "speculative.model", "hidden_size is 128 and the target's 256"),
        ({"target_hidden_size": 512}, "speculative.model", "target_hidden_size is 512"),
        ({"vocab_size": 4096}, "speculative.model", "vocab_size is 4096 and the target's 2048"),
        ({"draft_vocab_size": 1024}, "speculative.model", "no d2t mapping of 1024"),
        ({"draft_vocab_size": 4096}, "speculative.model", "larger than the target's vocabulary"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, "speculative.model", "it has 4 (ids 0..3)"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "speculative.model", "fc takes 768 inputs"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused_naming_the_key(
    tmp_path, head_copy, changes, key, words
):
    _bend(head_copy, **changes)
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {**HEAD, "model": str(head_copy)})
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_a_mapped_draft_vocabulary_is_checked_against_the_target(tmp_path, head_copy):
    """A smaller draft vocabulary with its d2t mapping (as speculators writes it): accepted while
    every mapped id is the target's, refused once one is not."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(head_copy / "model.safetensors"))
    small = 1024
    weights["lm_head.weight"] = weights["lm_head.weight"][:small].contiguous()
    weights["d2t"] = torch.zeros(small, dtype=torch.long)  # draft id i -> target id i
    save_file(weights, str(head_copy / "model.safetensors"))
    _bend(head_copy, draft_vocab_size=small)
    _check(tmp_path, {**HEAD, "model": str(head_copy)})
    weights["d2t"][-1] = 2048  # draft id 1023 -> 3071: outside the target's 2048
    save_file(weights, str(head_copy / "model.safetensors"))
    with pytest.raises(SpecError, match="outside the target's vocabulary"):
        _check(tmp_path, {**HEAD, "model": str(head_copy)})


def test_a_head_and_a_draft_given_as_each_other_are_refused(tmp_path, models):
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {"method": "draft_model", "model": HEAD["model"], "num_speculative_tokens": 3})
    assert err.value.key == "speculative.method" and "use method: eagle3" in str(err.value)
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {"method": "eagle3", "model": str(MODELS / "draft"), "num_speculative_tokens": 3})
    assert err.value.key == "speculative.method" and "use method: draft_model" in str(err.value)
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {"method": "eagle", "model": HEAD["model"], "num_speculative_tokens": 3})
    assert err.value.key == "speculative.method" and "use method: eagle3" in str(err.value)


@pytest.mark.skipif(
    importlib.util.find_spec("arctic_inference") is not None, reason="arctic-inference installed"
)
def test_suffix_decoding_without_its_package_is_refused_naming_it(models, tmp_path):
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {"method": "suffix", "num_speculative_tokens": 8})
    assert err.value.key == "speculative.method" and "arctic-inference" in str(err.value)


def test_validate_exits_2_naming_the_key_before_any_weights_load(tmp_path, head_copy):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["def f():"]}), tmp_path / "in" / "a.parquet")
    _bend(head_copy, eagle_aux_hidden_state_layer_ids=[1, 2, 7])
    spec = _spec(tmp_path, {**HEAD, "model": str(head_copy)})
    job = write_job(tmp_path / "job.yaml", **{k: v for k, v in spec.items() if k != "name"})
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 2, result.stderr
    assert "speculative.model" in result.stderr and "eagle_aux_hidden_state_layer_ids" in result.stderr


def test_a_head_retrained_in_place_is_a_changed_spec(tmp_path, head_copy, monkeypatch):
    from batchspec.spec import fingerprint as fingerprint_mod
    from batchspec.spec.fingerprint import describe_changes, spec_fingerprint

    monkeypatch.setattr(fingerprint_mod, "RACY_NS", 0)
    spec = build_spec(_spec(tmp_path, {**HEAD, "model": str(head_copy)}))
    before = spec_fingerprint(spec)
    weights = head_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(weights, "r+b") as handle:  # in place, the same size: a retrained head
        handle.write(data)
    assert describe_changes(before, spec_fingerprint(spec)) == ["speculative.model"]


def test_lora_adapters_beside_a_head_are_refused_naming_the_key(tmp_path, models):
    """vLLM 0.32 hands a head the target's LoRA-wrapped embedding and fails on its first draft
    step (seen on the CPU build: ``einsum(): subscript b has size ...``): refused before any
    weights load, in a job and among tune's and auto's candidates."""
    from batchspec.tune.session import check_candidate_models

    raw = _spec(tmp_path, HEAD)
    raw["model"]["lora"] = {"adapters": {"upper": str(MODELS / "lora-upper")}}
    from batchspec.engine.checks import check_vllm_keys

    with pytest.raises(SpecError) as err:
        check_vllm_keys(build_spec(raw))
    assert err.value.key == "model.lora" and "EAGLE3 head" in str(err.value)
    raw["speculative"] = None
    with pytest.raises(SpecError) as err:
        check_candidate_models(build_spec(raw), [str(MODELS / "draft"), HEAD["model"]], "speculative.drafts")
    assert err.value.key == "speculative.drafts[1]"


@pytest.mark.parametrize(
    "bend, words",
    [
        (lambda h: (h / "config.json").write_text("{not json"), "cannot be read as JSON"),
        (lambda h: (h / "config.json").write_text("[1, 2]"), "holds a JSON list, not an object"),
        (lambda h: _bend(h, hidden_size="256"), "hidden_size is '256', not a positive whole number"),
        (lambda h: _bend(h, draft_vocab_size=True), "draft_vocab_size is True"),
        (lambda h: _bend(h, eagle_aux_hidden_state_layer_ids=3), "is 3, not a list of layer ids"),
        (
            lambda h: _bend(h, eagle_aux_hidden_state_layer_ids=[1, "2", None]),
            "name layers the target does not",
        ),
        (lambda h: (h / "model.safetensors").write_bytes(b"\xff" * 16), "not a readable safetensors file"),
        (
            lambda h: (h / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0[]"),
            "not a readable safetensors",
        ),
    ],
)
def test_a_head_with_values_of_the_wrong_type_is_refused_naming_the_key(tmp_path, head_copy, bend, words):
    """Every field of the head's config and its weight files' headers, mistyped or torn: exit 2
    naming ``speculative.model``, never a crash."""
    bend(head_copy)
    with pytest.raises(SpecError) as err:
        _check(tmp_path, {**HEAD, "model": str(head_copy)})
    assert err.value.key == "speculative.model" and words in str(err.value), str(err.value)
