"""Job spec loading: YAML, ${VAR}, --set, validation errors that name the key (exit 2)."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli

from batchspec.errors import SpecError
from batchspec.spec import apply_override, load_spec, redact

BASE = {
    "name": "t",
    "input": {"path": "data/*.parquet", "prompt_column": "prompt"},
    "output": {"path": "out/t"},
    "model": {"target": "some/model", "engine": {"max_model_len": 256}},
    "sampling": {"temperature": 0.0, "max_tokens": 8},
}


def write(tmp_path, spec) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec) if isinstance(spec, dict) else spec)
    return str(path)


def load(tmp_path, spec, overrides=(), environ=None):
    return load_spec(write(tmp_path, spec), overrides, environ=environ or {})


def test_minimal_spec_loads_with_defaults(tmp_path):
    spec = load(tmp_path, BASE)
    assert spec.input.paths == ("data/*.parquet",)
    assert spec.input.id_column is None
    assert spec.output.keep_columns is None
    assert spec.speculative is None
    assert spec.execution.max_in_flight == 512
    assert spec.sampling == {"temperature": 0.0, "max_tokens": 8}


def test_set_overrides_parse_values_as_yaml(tmp_path):
    spec = load(tmp_path, BASE, ["sampling.max_tokens=32", "speculative.method=ngram",
                                 "speculative.num_speculative_tokens=3",
                                 "output.keep_columns=[id, topic]"])
    assert spec.sampling["max_tokens"] == 32
    assert spec.speculative == {"method": "ngram", "num_speculative_tokens": 3}
    assert spec.output.keep_columns == ("id", "topic")


def test_env_vars_expand_with_defaults(tmp_path):
    raw = dict(BASE, input={"path": "s3://${BUCKET}/in/${DAY:-latest}/*.parquet",
                            "prompt_column": "prompt"})
    spec = load(tmp_path, raw, environ={"BUCKET": "prompts"})
    assert spec.input.paths == ("s3://prompts/in/latest/*.parquet",)


def test_missing_env_var_names_key_and_variable(tmp_path):
    raw = dict(BASE, output={"path": "${OUT_DIR}/x"})
    with pytest.raises(SpecError, match=r"output\.path.*\$\{OUT_DIR\} is not set"):
        load(tmp_path, raw)


@pytest.mark.parametrize("mutate, key, words", [
    (lambda s: s["input"].update(promt_column="x"), "input.promt_column", "did you mean 'prompt_column'"),
    (lambda s: s.update(sampeling={}), "sampeling", "unknown key"),
    (lambda s: s["output"].pop("path"), "output.path", "missing required key"),
    (lambda s: s.pop("model"), "model", "missing required section"),
    (lambda s: s["output"].update(row_group_rows="many"), "output.row_group_rows", "expected an integer"),
    (lambda s: s["output"].update(row_group_rows=0), "output.row_group_rows", "positive"),
    (lambda s: s["input"].update(messages_column="m"), "input.prompt_column", "exactly one"),
    (lambda s: s["input"].update(on_bad_shard="ignore"), "input.on_bad_shard", "'fail' or 'skip'"),
    (lambda s: s["input"].update(sampling_columns={"max_token": "m"}), "input.sampling_columns.max_token",
     "did you mean 'max_tokens'"),
    (lambda s: s.update(speculative={"num_speculative_tokens": 4}), "speculative.method", "give a method"),
    (lambda s: s.update(speculative="draft"), "speculative", "expected a mapping"),
    (lambda s: s["model"]["engine"].update(speculative_config={}), "model.engine.speculative_config",
     "`speculative`"),
])
def test_bad_specs_name_the_key(tmp_path, mutate, key, words):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(raw)
    with pytest.raises(SpecError) as info:
        load(tmp_path, raw)
    assert info.value.key == key
    assert words in str(info.value)
    assert info.value.exit_code == 2


def test_shorthand_draft_model_without_method(tmp_path):
    spec = load(tmp_path, dict(BASE, speculative={"model": "d", "num_speculative_tokens": 4}))
    assert spec.speculative == {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}


@pytest.mark.parametrize("item", ["novalue", "=3", "a..b=1"])
def test_malformed_set(item):
    with pytest.raises(SpecError, match="KEY=VALUE"):
        apply_override({}, item)


def test_set_into_scalar_names_key():
    with pytest.raises(SpecError) as info:
        apply_override({"sampling": 3}, "sampling.max_tokens=3")
    assert info.value.key == "sampling"


def test_redact_removes_credentials_only_in_storage_options():
    raw = {"input": {"storage_options": {"key": "AKIA", "secret": "s3cr3t", "token": "t",
                                         "client_kwargs": {"endpoint_url": "http://x",
                                                           "aws_secret_access_key": "zz"}}},
           "speculative": {"num_speculative_tokens": 4}}
    out = redact(raw)
    so = out["input"]["storage_options"]
    assert so["key"] == so["secret"] == so["token"] == "***"
    assert so["client_kwargs"] == {"endpoint_url": "http://x", "aws_secret_access_key": "***"}
    assert out["speculative"] == {"num_speculative_tokens": 4}
    assert raw["input"]["storage_options"]["secret"] == "s3cr3t"  # the original is untouched


def test_vllm_owned_keys_are_checked_against_vllm(tmp_path):
    from batchspec.engine import check_vllm_keys

    check_vllm_keys(load(tmp_path, dict(BASE, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 4})))
    for raw, key in [
        (dict(BASE, sampling={"temprature": 0.5}), "sampling.temprature"),
        (dict(BASE, speculative={"method": "ngram", "num_speculative_token": 3}),
         "speculative.num_speculative_token"),
        (dict(BASE, model={"target": "m", "engine": {"max_model_length": 3}}),
         "model.engine.max_model_length"),
        (dict(BASE, sampling={"temperature": -1}), "sampling"),
    ]:
        with pytest.raises(SpecError) as info:
            check_vllm_keys(load(tmp_path, raw))
        assert info.value.key == key


def test_cli_exits_2_naming_the_key(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw["sampling"]["temprature"] = 0.3
    job = write(tmp_path, raw)
    for command in ("run", "validate"):
        result = run_cli(command, job, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "sampling.temprature" in result.stderr
        assert "did you mean 'temperature'" in result.stderr


def test_cli_exits_2_on_bad_yaml_and_bad_set(tmp_path):
    job = write(tmp_path, "input: [unclosed")
    result = run_cli("run", job, timeout=60)
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    job = write(tmp_path, BASE)
    result = run_cli("run", job, "--set", "sampling", timeout=60)
    assert result.returncode == 2 and "KEY=VALUE" in result.stderr
    result = run_cli("run", job, "--worker-index", "3", "--num-workers", "2", timeout=60)
    assert result.returncode == 2 and "--worker-index" in result.stderr
    result = run_cli("run", str(tmp_path / "missing.yaml"), timeout=60)
    assert result.returncode == 2
