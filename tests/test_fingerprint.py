"""The output fingerprint: which parts of a spec shape the output, hashed per component, and
which changed between two runs."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from batchspec.fingerprint import (
    COMPONENTS,
    FINGERPRINT_VERSION,
    describe_changes,
    spec_fingerprint,
)
from batchspec.spec import build_spec


def make_model(path, hidden=64, weights=b"\0" * 1000, tokenizer='{"vocab": {"a": 0}}'):
    """A directory shaped like a Hugging Face model (nothing loads it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden, "vocab_size": 256}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text(tokenizer)
    (path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return path


def raw_spec(tmp_path, **changes):
    raw = {
        "name": "fp",
        "input": {"path": "in/*.parquet", "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": "out/", "keep_columns": ["id"]},
        "model": {"target": str(tmp_path / "target"),
                  "engine": {"max_model_len": 512, "dtype": "float32", "enforce_eager": True}},
        "speculative": {"method": "draft_model", "model": str(tmp_path / "draft"),
                        "num_speculative_tokens": 4},
        "sampling": {"temperature": 0.0, "max_tokens": 32},
    }
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        if value is _DELETE:
            node.pop(last)
        else:
            node[last] = value
    return raw


_DELETE = object()


@pytest.fixture
def models(tmp_path):
    make_model(tmp_path / "target")
    make_model(tmp_path / "draft", hidden=32, weights=b"\0" * 500)
    return tmp_path


def fp(tmp_path, **changes):
    return spec_fingerprint(build_spec(raw_spec(tmp_path, **changes)))


def test_components_are_short_hex_and_stable(models):
    first = fp(models)
    assert list(first) == list(COMPONENTS)
    assert all(re.fullmatch(r"[0-9a-f]{16}", v) for v in first.values())
    assert fp(models) == first
    assert FINGERPRINT_VERSION == 1


@pytest.mark.parametrize("changes, changed", [
    ({"sampling__max_tokens": 64}, ["sampling"]),
    ({"sampling__temperature": 0.7}, ["sampling"]),
    ({"speculative__num_speculative_tokens": 2}, ["speculative"]),
    ({"speculative": None}, ["speculative.model", "speculative"]),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 4}},
     ["speculative.model", "speculative"]),
    ({"model__engine__dtype": "bfloat16"}, ["model.engine"]),
    ({"model__engine__max_model_len": 1024}, ["model.engine"]),
    ({"model__engine__kv_cache_dtype": "fp8"}, ["model.engine"]),
    ({"model__engine__seed": 7}, ["model.engine"]),
    ({"model__engine__hf_overrides": {"rope_theta": 1e6}}, ["model.engine"]),
    ({"model__engine__some_future_vllm_arg": 3}, ["model.engine"]),  # unknown: counts
    ({"input__prompt_column": _DELETE, "input__messages_column": "messages"}, ["columns"]),
    ({"input__id_column": "uid"}, ["columns"]),
    ({"input__sampling_columns": {"max_tokens": "mt"}}, ["columns"]),
    ({"output__keep_columns": ["id", "topic"]}, ["columns"]),
    ({"output__keep_columns": _DELETE}, ["columns"]),  # all columns differs from [id]
])
def test_what_changes_the_output_is_seen(models, changes, changed):
    assert describe_changes(fp(models), fp(models, **changes)) == changed


@pytest.mark.parametrize("changes", [
    {"model__engine__max_num_seqs": 8},
    {"model__engine__gpu_memory_utilization": 0.5},
    {"model__engine__enforce_eager": False},
    {"model__engine__tensor_parallel_size": 2},
    {"model__engine__enable_prefix_caching": True},
    {"model__engine__max_num_batched_tokens": 4096},
    {"model__engine__disable_log_stats": False},
    {"model__engine__hf_token": "hf_secret_one"},
    {"input__storage_options": {"key": "AKIA", "secret": "s3cr3t"}},
    {"output__storage_options": {"token": "t0k3n"}},
    {"input__path": "s3://bucket/other/*.parquet"},
    {"output__path": "s3://bucket/elsewhere/"},
    {"output__row_group_rows": 7, "output__compression": "snappy"},
    {"execution": {"max_in_flight": 3, "grace_s": 1, "lease_s": 10}},
    {"name": "renamed"},
])
def test_throughput_knobs_secrets_and_places_do_not_count(models, changes):
    assert describe_changes(fp(models), fp(models, **changes)) == []


def test_local_model_identity_is_its_contents(models, tmp_path):
    base = fp(models)
    # the same model copied elsewhere is the same model
    shutil.copytree(models / "target", tmp_path / "copy")
    assert fp(models, model__target=str(tmp_path / "copy")) == base
    # re-indenting config.json is not a new model
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config, indent=4))
    assert fp(models, model__target=str(tmp_path / "copy")) == base
    for change in (
        lambda d: (d / "config.json").write_text(json.dumps({**config, "hidden_size": 65})),
        lambda d: (d / "model.safetensors").write_bytes(b"\0" * 1001),
        lambda d: (d / "model-00002-of-00002.safetensors").write_bytes(b"\0"),
        lambda d: (d / "tokenizer.json").write_text('{"vocab": {"b": 0}}'),
        lambda d: (d / "tokenizer_config.json").write_text('{"chat_template": "other"}'),
        lambda d: (d / "generation_config.json").write_text('{"temperature": 0.6}'),
    ):
        changed = tmp_path / "changed"
        shutil.rmtree(changed, ignore_errors=True)
        shutil.copytree(models / "target", changed)
        change(changed)
        assert describe_changes(base, fp(models, model__target=str(changed))) == ["model.target"]


def test_draft_identity_and_absence(models, tmp_path):
    make_model(tmp_path / "draft2", hidden=48)
    assert describe_changes(fp(models), fp(models, speculative__model=str(tmp_path / "draft2"))) \
        == ["speculative.model"]
    without = fp(models, speculative=None)
    assert "speculative.model" not in without
    ngram = fp(models, speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert "speculative.model" not in ngram


def test_hub_model_identity_is_id_and_revisions(models):
    hub = fp(models, model__target="org/some-model")
    assert describe_changes(hub, fp(models, model__target="org/other-model")) == ["model.target"]
    changed = describe_changes(hub, fp(models, model__target="org/some-model",
                                       model__engine__revision="abc123"))
    assert changed == ["model.target", "model.engine"]
    changed = describe_changes(hub, fp(models, model__target="org/some-model",
                                       model__engine__tokenizer_revision="v2"))
    assert changed == ["model.target", "model.engine"]
    draft_rev = fp(models, model__target="org/some-model",
                   speculative={"model": "org/draft", "num_speculative_tokens": 4})
    draft_rev2 = fp(models, model__target="org/some-model",
                    speculative={"model": "org/draft", "num_speculative_tokens": 4, "revision": "r2"})
    assert describe_changes(draft_rev, draft_rev2) == ["speculative.model", "speculative"]


def test_a_new_url_signature_is_the_same_model(models):
    one = fp(models, model__target="https://u:pw@models.example/m?X-Amz-Signature=aaaa")
    two = fp(models, model__target="https://v:pw2@models.example/m?X-Amz-Signature=bbbb")
    assert one == two


def test_describe_changes_order_and_missing_components():
    old = {"model.target": "1", "sampling": "2", "columns": "3", "zeta": "9"}
    new = {"columns": "4", "model.target": "1", "speculative.model": "5", "alpha": "0",
           "sampling": "2"}
    assert describe_changes(old, new) == ["speculative.model", "columns", "alpha", "zeta"]
    assert describe_changes(new, old) == ["speculative.model", "columns", "alpha", "zeta"]
    assert describe_changes({}, {}) == []
