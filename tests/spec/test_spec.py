"""Job spec loading: YAML, ${VAR}, --set, validation errors that name the key (exit 2)."""

from __future__ import annotations

import time

import pytest
import yaml
from helpers.jobs import run_cli, run_cli_in_process

from batchspec.errors import SpecError
from batchspec.redact import public_spec
from batchspec.spec.load import apply_override, load_spec

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


def test_every_default_comes_from_the_dataclasses(tmp_path, monkeypatch):
    """build_spec restates no default: a spec with only the required keys gets what the
    dataclasses declare, and a changed dataclass default is the one a job gets."""
    from batchspec.spec.model import (
        DEFAULT_JOB_NAME,
        ExecutionSpec,
        ExecutorSpec,
        InputSpec,
        ModelSpec,
        OutputSpec,
    )

    raw = yaml.safe_load(yaml.safe_dump(BASE))
    del raw["name"]
    spec = load(tmp_path, raw)
    assert spec.name == DEFAULT_JOB_NAME
    assert spec.input == InputSpec(paths=("data/*.parquet",), prompt_column="prompt")
    assert spec.output == OutputSpec(path="out/t")
    assert spec.model == ModelSpec(target="some/model", engine={"max_model_len": 256})
    assert spec.execution == ExecutionSpec() and spec.executor == ExecutorSpec()
    for cls, key, value in (
        (OutputSpec, "row_group_rows", 7),
        (ExecutionSpec, "lease_s", 9.5),
        (ExecutorSpec, "kind", "ray"),
        (InputSpec, "on_bad_shard", "skip"),
    ):
        monkeypatch.setattr(cls.__dataclass_fields__[key], "default", value)
    spec = load(tmp_path, raw)
    assert (
        spec.output.row_group_rows,
        spec.execution.lease_s,
        spec.executor.kind,
        spec.input.on_bad_shard,
    ) == (7, 9.5, "ray", "skip")


def test_set_overrides_parse_values_as_yaml(tmp_path):
    spec = load(
        tmp_path,
        BASE,
        [
            "sampling.max_tokens=32",
            "speculative.method=ngram",
            "speculative.num_speculative_tokens=3",
            "output.keep_columns=[id, topic]",
        ],
    )
    assert spec.sampling["max_tokens"] == 32
    assert spec.speculative == {"method": "ngram", "num_speculative_tokens": 3}
    assert spec.output.keep_columns == ("id", "topic")


def test_env_vars_expand_with_defaults(tmp_path):
    raw = dict(BASE, input={"path": "s3://${BUCKET}/in/${DAY:-latest}/*.parquet", "prompt_column": "prompt"})
    spec = load(tmp_path, raw, environ={"BUCKET": "prompts"})
    assert spec.input.paths == ("s3://prompts/in/latest/*.parquet",)


def test_missing_env_var_names_key_and_variable(tmp_path):
    raw = dict(BASE, output={"path": "${OUT_DIR}/x"})
    with pytest.raises(SpecError, match=r"output\.path.*\$\{OUT_DIR\} is not set"):
        load(tmp_path, raw)


@pytest.mark.parametrize(
    "mutate, key, words",
    [
        (lambda s: s["input"].update(promt_column="x"), "input.promt_column", "did you mean 'prompt_column'"),
        (lambda s: s.update(sampeling={}), "sampeling", "unknown key"),
        (lambda s: s["output"].pop("path"), "output.path", "missing required key"),
        (lambda s: s.pop("model"), "model", "missing required section"),
        (lambda s: s["output"].update(row_group_rows="many"), "output.row_group_rows", "expected an integer"),
        (lambda s: s["output"].update(row_group_rows=0), "output.row_group_rows", "positive"),
        (lambda s: s["input"].update(messages_column="m"), "input.prompt_column", "exactly one"),
        (lambda s: s["input"].update(on_bad_shard="ignore"), "input.on_bad_shard", "'fail' or 'skip'"),
        (
            lambda s: s["input"].update(sampling_columns={"max_token": "m"}),
            "input.sampling_columns.max_token",
            "did you mean 'max_tokens'",
        ),
        (
            lambda s: s.update(speculative={"num_speculative_tokens": 4}),
            "speculative.method",
            "give a method",
        ),
        (lambda s: s.update(speculative="draft"), "speculative", "expected a mapping"),
        (
            lambda s: s["model"]["engine"].update(speculative_config={}),
            "model.engine.speculative_config",
            "`speculative`",
        ),
        # LoRA: adapters are named under model.lora, rows pick one of them
        (
            lambda s: s["model"]["engine"].update(enable_lora=True),
            "model.engine.enable_lora",
            "`model.lora.adapters`",
        ),
        (
            lambda s: s["model"]["engine"].update(max_lora_rank=8),
            "model.engine.max_lora_rank",
            "`model.lora.max_lora_rank`",
        ),
        (lambda s: s["input"].update(lora_column="adapter"), "input.lora_column", "model.lora is not set"),
        (lambda s: s["model"].update(lora={"adapters": {}}), "model.lora.adapters", "at least one"),
        (lambda s: s["model"].update(lora={"max_loras": 2}), "model.lora.adapters", "missing required"),
        (
            lambda s: s["model"].update(lora={"adapters": {"a": "s3://b/a"}}),
            "model.lora.adapters.a",
            "not from a URL",
        ),
        (
            lambda s: s["model"].update(lora={"adapters": {"a": 3}}),
            "model.lora.adapters.a",
            "local directory or a model id",
        ),
        (
            lambda s: s["model"].update(lora={"adapters": {"upper": "x/y"}, "adapter": "uper"}),
            "model.lora.adapter",
            "did you mean 'upper'",
        ),
        (
            lambda s: s["model"].update(lora={"adapters": {"a": "x/y"}, "max_loras": 0}),
            "model.lora.max_loras",
            "positive",
        ),
        (
            lambda s: s["model"].update(lora={"adapters": {"a": "x/y"}, "rank": 8}),
            "model.lora.rank",
            "unknown key",
        ),
    ],
)
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


def test_the_public_view_masks_every_storage_option_and_keeps_the_rest():
    raw = {
        "input": {
            "storage_options": {
                "key": "AKIA",
                "secret": "s3cr3t",
                "token": "t",
                "client_kwargs": {"endpoint_url": "http://u:pw@x", "aws_secret_access_key": "zz"},
            }
        },
        "speculative": {"num_speculative_tokens": 4},
    }
    out = public_spec(raw)
    so = out["input"]["storage_options"]
    assert so["key"] == so["secret"] == so["token"] == "***"
    # an endpoint may carry a login: every value under storage_options is hidden, keys stay
    assert so["client_kwargs"] == {"endpoint_url": "***", "aws_secret_access_key": "***"}
    assert out["speculative"] == {"num_speculative_tokens": 4}
    assert raw["input"]["storage_options"]["secret"] == "s3cr3t"  # the original is untouched


def test_jobspec_views_hide_credentials_outside_storage_options(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw["model"]["engine"]["hf_token"] = "hf_secret_value"
    raw["input"]["path"] = "s3://AKIA:s3cr3t@bucket/in/*.parquet"
    spec = load(tmp_path, raw)
    view = spec.public()
    assert view["model"]["engine"] == {"max_model_len": 256, "hf_token": "***"}
    assert view["input"]["path"] == "s3://bucket/in/*.parquet"
    assert {"hf_secret_value", "s3cr3t"} <= spec.secret_values()


# --------------------------------------------------------------------------- YAML limits

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_billion_laughs_is_refused_fast_naming_the_file(tmp_path):
    path = write(tmp_path, BILLION_LAUGHS)
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_spec(path, environ={})
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert path in message and "refused" in message and "nodes" in message
    assert info.value.exit_code == 2


def test_too_many_aliases_are_refused(tmp_path):
    aliases = ", ".join(["*x"] * 150)
    text = yaml.safe_dump(BASE) + f"extra: [&x 1, {aliases}]\n"
    with pytest.raises(SpecError, match=r"job\.yaml: refused: more than 100 YAML aliases"):
        load(tmp_path, text)


def test_recursive_alias_is_refused(tmp_path):
    with pytest.raises(SpecError, match="refers to a node that contains it"):
        load(tmp_path, "a: &a [1, *a]\n")


def test_set_value_is_held_to_the_same_limits(tmp_path):
    levels = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    for prev, level in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{level}: &{level} [" + ", ".join([f"*{prev}"] * 9) + "]")
    bomb = "{" + ", ".join(levels) + "}"  # the same document, in flow style, in one argument
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load(tmp_path, BASE, [f"sampling.stop={bomb}"])
    assert time.perf_counter() - start < 1.0
    assert info.value.key == "sampling.stop"
    assert "--set sampling.stop: refused" in str(info.value)


SHARED_ANCHOR = """\
name: shared
input:
  path: s3://bucket/in/*.parquet
  prompt_column: prompt
  storage_options: &store
    key: AKIA
    secret: s3cr3t
    client_kwargs: {endpoint_url: "http://127.0.0.1:9000"}
output:
  path: s3://bucket/out/
  storage_options: *store
model: {target: some/model}
sampling: &sampling {temperature: 0.0, max_tokens: 8}
execution:
  <<: {max_in_flight: 4, read_batch_rows: 2}
  read_batch_rows: 3
"""


def test_shared_anchor_spec_loads_and_stays_independent(tmp_path):
    spec = load(tmp_path, SHARED_ANCHOR, ["output.storage_options.key=OTHER"])
    assert spec.input.storage_options == {
        "key": "AKIA",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
    }
    # the alias gave output its own copy: --set on it leaves input alone
    assert spec.output.storage_options["key"] == "OTHER"
    assert spec.output.storage_options["secret"] == "s3cr3t"
    assert (spec.execution.max_in_flight, spec.execution.read_batch_rows) == (4, 3)  # merge key


def test_yaml_errors_do_not_quote_the_line(tmp_path):
    # PyYAML quotes the offending line; it may hold a credential
    with pytest.raises(SpecError) as info:
        load(tmp_path, 'input:\n  storage_options: {secret: "hunter2\\q"}\n')
    assert "not valid YAML" in str(info.value) and "line 2" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(SpecError) as info:
        load(tmp_path, BASE, ['input.storage_options={secret: "hunter2\\q"}'])
    assert "--set input.storage_options: value is not valid YAML" in str(info.value)
    assert "hunter2" not in str(info.value)


# --------------------------------------------------------------------------- typed ${VAR}

TYPED = """\
name: typed
input:
  path: "s3://b/${DS}/x/*.parquet"
  prompt_column: prompt
output: {path: "out/${DS}"}
model:
  target: "${MODEL:-some/model}"
  engine:
    max_model_len: ${LEN}
    enforce_eager: ${EAGER}
sampling:
  max_tokens: ${N}
  temperature: ${TEMP:-0.5}
  seed: "${N}"
  stop:
    - ${STOP}
    - '${N}'
  top_p: ${EMPTY}
execution:
  grace_s: ${GRACE:-0}
"""
TYPED_ENV = {"DS": "2026-01-02", "N": "32", "LEN": "512", "EAGER": "true", "STOP": "END", "EMPTY": ""}


def test_plain_vars_are_typed_as_yaml_would_type_them(tmp_path):
    spec = load(tmp_path, TYPED, environ=TYPED_ENV)
    assert spec.sampling["max_tokens"] == 32 and type(spec.sampling["max_tokens"]) is int
    assert spec.sampling["temperature"] == 0.5 and type(spec.sampling["temperature"]) is float
    assert spec.model.engine == {"max_model_len": 512, "enforce_eager": True}
    assert spec.sampling["top_p"] is None  # empty plain value: null, as in YAML
    assert spec.execution.grace_s == 0.0
    # quoted stays a string; a variable inside a longer value gives a string
    assert spec.sampling["seed"] == "32"
    assert spec.sampling["stop"] == ["END", "32"]
    assert spec.input.paths == ("s3://b/2026-01-02/x/*.parquet",)
    assert spec.model.target == "some/model"


def test_plain_var_holding_a_date_stays_a_string(tmp_path):
    spec = load(tmp_path, dict(BASE, name="${DAY}"), environ={"DAY": "2026-01-02"})
    assert spec.name == "2026-01-02"


def test_keys_are_not_expanded(tmp_path):
    text = yaml.safe_dump(BASE) + "execution:\n  ${KEY}: 3\n"
    with pytest.raises(SpecError) as info:
        load(tmp_path, text, environ={"KEY": "max_in_flight"})
    assert info.value.key == "execution.${KEY}"


def test_set_values_are_expanded_and_typed(tmp_path):
    spec = load(
        tmp_path,
        BASE,
        ["sampling.max_tokens=${N}", "sampling.seed='${N}'", "output.path=out/${N}"],
        environ={"N": "16"},
    )
    assert spec.sampling["max_tokens"] == 16 and spec.sampling["seed"] == "16"
    assert spec.output.path == "out/16"


@pytest.mark.parametrize(
    "text, overrides, key",
    [
        (TYPED, [], "input.path"),
        ("name: x\nlist:\n  - a\n  - ${NOPE}\n", [], "list[1]"),
        (yaml.safe_dump(BASE), ["sampling.max_tokens=${NOPE}"], "sampling.max_tokens"),
    ],
)
def test_unset_var_names_key_and_variable(tmp_path, text, overrides, key):
    env = {k: v for k, v in TYPED_ENV.items() if k != "DS"}
    with pytest.raises(SpecError) as info:
        load(tmp_path, text, overrides, environ=env)
    assert info.value.key == key
    assert "is not set in the environment" in str(info.value)
    assert "${DS}" in str(info.value) or "${NOPE}" in str(info.value)


def test_unset_var_replaced_by_set_is_fine(tmp_path):
    raw = dict(BASE, output={"path": "${OUT_DIR}/x"})
    spec = load(tmp_path, raw, ["output.path=elsewhere"])
    assert spec.output.path == "elsewhere"


# --------------------------------------------------------------------------- new keys


def test_new_keys_defaults(tmp_path):
    spec = load(tmp_path, BASE)
    assert spec.input.allow_empty is False
    assert spec.execution.grace_s == 30.0 and spec.execution.lease_s == 120.0


def test_new_keys_set(tmp_path):
    spec = load(tmp_path, BASE, ["input.allow_empty=true", "execution.grace_s=0", "execution.lease_s=2.5"])
    assert spec.input.allow_empty is True
    assert spec.execution.grace_s == 0.0 and spec.execution.lease_s == 2.5


@pytest.mark.parametrize(
    "item, key, words",
    [
        ("input.allow_empty=yes please", "input.allow_empty", "expected a boolean"),
        ("input.allow_empty=1", "input.allow_empty", "expected a boolean"),
        ("execution.grace_s=-1", "execution.grace_s", "zero or more"),
        ("execution.grace_s=.inf", "execution.grace_s", "zero or more"),
        ("execution.lease_s=0", "execution.lease_s", "more than zero"),
        ("execution.lease_s=true", "execution.lease_s", "got a boolean"),
        ("execution.lease_s=soon", "execution.lease_s", "expected an integer or a number"),
    ],
)
def test_new_keys_bad_values(tmp_path, item, key, words):
    with pytest.raises(SpecError) as info:
        load(tmp_path, BASE, [item])
    assert info.value.key == key
    assert words in str(info.value)


@pytest.mark.vllm
def test_vllm_owned_keys_are_checked_against_vllm(tmp_path):
    from batchspec.engine.checks import check_vllm_keys

    check_vllm_keys(
        load(
            tmp_path,
            dict(BASE, speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}),
        )
    )
    for raw, key in [
        (dict(BASE, sampling={"temprature": 0.5}), "sampling.temprature"),
        (
            dict(BASE, speculative={"method": "ngram", "num_speculative_token": 3}),
            "speculative.num_speculative_token",
        ),
        (
            dict(BASE, model={"target": "m", "engine": {"max_model_length": 3}}),
            "model.engine.max_model_length",
        ),
        (dict(BASE, sampling={"temperature": -1}), "sampling"),
    ]:
        with pytest.raises(SpecError) as info:
            check_vllm_keys(load(tmp_path, raw))
        assert info.value.key == key


@pytest.mark.vllm
def test_cli_exits_2_naming_the_key(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw["sampling"]["temprature"] = 0.3
    job = write(tmp_path, raw)
    # the console script once (what a scheduler runs); validate in this process, the same entry point
    for result in (run_cli("run", job, timeout=120), run_cli_in_process("validate", job)):
        assert result.returncode == 2, result.stderr
        assert "sampling.temprature" in result.stderr
        assert "did you mean 'temperature'" in result.stderr


@pytest.mark.parametrize(
    "fmt, key, largest",
    [("lance", "version", 2**64 - 1), ("delta", "version", 2**63 - 1), ("iceberg", "snapshot", 2**63 - 1)],
)
def test_a_table_pin_past_what_its_library_takes_is_exit_2_naming_the_key(tmp_path, fmt, key, largest):
    """Lance's versions are unsigned 64-bit numbers, Delta's versions and Iceberg's snapshot ids
    signed ones: a larger pin was exit 1 ("int too big to convert") once the table was opened."""
    from click.testing import CliRunner

    from batchspec.cli import main

    where = (
        {"table": "ns.t", "catalog": {"type": "sql", "uri": f"sqlite:///{tmp_path}/c.db"}}
        if fmt == "iceberg"
        else {"path": str(tmp_path / "in")}
    )
    raw = {**BASE, "input": {"format": fmt, "prompt_column": "prompt", **where, key: largest + 1}}
    result = CliRunner().invoke(main, ["validate", write(tmp_path, raw)])
    assert result.exit_code == 2, result.output
    assert f"input.{key}: expected a {key} number, 0 to {largest}, got {largest + 1}" in result.stderr
    assert getattr(load(tmp_path, {**raw, "input": {**raw["input"], key: largest}}).input, key) == largest


@pytest.mark.vllm  # validate checks the spec against vLLM's config classes first
@pytest.mark.parametrize(
    "section, key",
    [
        ({"model": {**BASE["model"], "target": "/an/absolute/path/that/does/not/exist"}}, "model.target"),
        (
            {"speculative": {"model": "/an/absolute/path/that/does/not/exist", "num_speculative_tokens": 2}},
            "speculative.model",
        ),
        (
            {"speculative": {"method": "eagle3", "model": "~/no-such-head", "num_speculative_tokens": 2}},
            "speculative.model",
        ),
        ({"speculative": {"method": "auto", "drafts": ["./no-such-draft"]}}, "speculative.drafts[0]"),
    ],
)
def test_a_model_path_with_nothing_there_is_exit_2_naming_the_key(tmp_path, section, key):
    """A path is no model id: vLLM would try it as one after its start-up, and validate said
    "spec OK"."""
    from click.testing import CliRunner

    from batchspec.cli import main

    result = CliRunner().invoke(main, ["validate", write(tmp_path, {**BASE, **section})])
    assert result.exit_code == 2, result.output
    assert f"{key}: " in result.stderr and "no such" in result.stderr, result.stderr


@pytest.mark.vllm
def test_cli_exits_2_on_bad_yaml_and_bad_set(tmp_path):
    job = write(tmp_path, "input: [unclosed")
    result = run_cli_in_process("run", job)
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    job = write(tmp_path, BASE)
    result = run_cli_in_process("run", job, "--set", "sampling")
    assert result.returncode == 2 and "KEY=VALUE" in result.stderr
    result = run_cli_in_process("run", job, "--worker-index", "3", "--num-workers", "2")
    assert result.returncode == 2 and "--worker-index" in result.stderr
    result = run_cli_in_process("run", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2
