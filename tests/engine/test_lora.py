"""LoRA adapters of the target (``model.lora``, ``input.lora_column``).

Without an engine: adapter directories checked before any weights load (exit 2 naming the key),
vLLM's rank chosen to fit, a row naming no adapter of the job an error row (and a bad row to
``validate``).

On the real engine, with the two tiny adapters ``make models`` trains (``lora-upper`` writes its
continuation upper-cased, ``lora-comment`` comments every line out): rows of both adapters and
of the base model interleaved in one shard, greedy, with speculation off, a draft model and
n-gram lookup; every row equal to a run of that adapter alone (the job-wide ``model.lora.adapter``)
and the base rows equal to an engine without LoRA."""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pytest
from helpers.jobs import DRAFT, ENGINE, MODELS, NGRAM, read_output, write_job, write_parquet
from tiny_lora import comment_share, upper_share  # tools/ is on the path (conftest.py)

from batchspec.engine.lora import Adapters, check_lora, engine_args, read_adapters
from batchspec.errors import SpecError
from batchspec.spec.build import build_spec
from batchspec.spec.load import load_spec

UPPER, COMMENT = MODELS / "lora-upper", MODELS / "lora-comment"


def make_adapter(path, r=8, peft_type="LORA", weights=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": r, "lora_alpha": 16}))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return path


def lora_spec(tmp_path, lora: dict, **input_keys):
    return build_spec(
        {
            "input": {"path": "in/*.parquet", "prompt_column": "prompt", **input_keys},
            "output": {"path": str(tmp_path / "out")},
            "model": {"target": "some/model", "lora": lora},
        }
    )


@pytest.mark.parametrize(
    "setup, key, words",
    [
        (lambda d: None, "model.lora.adapters.a", "no adapter directory"),
        (lambda d: d.mkdir(), "model.lora.adapters.a", "no adapter_config.json"),
        (lambda d: make_adapter(d, peft_type="IA3"), "model.lora.adapters.a", "LoRA adapters only"),
        (lambda d: make_adapter(d, r="eight"), "model.lora.adapters.a", "no rank r"),
        (lambda d: make_adapter(d, weights=False), "model.lora.adapters.a", "no weights"),
        (
            lambda d: (d.mkdir(), (d / "adapter_config.json").write_text("{not json")),
            "model.lora.adapters.a",
            "cannot read",
        ),
    ],
)
def test_a_bad_adapter_directory_is_refused_naming_its_key(tmp_path, setup, key, words):
    setup(tmp_path / "a")
    spec = lora_spec(tmp_path, {"adapters": {"a": str(tmp_path / "a")}})
    with pytest.raises(SpecError) as info:
        check_lora(spec)
    assert info.value.key == key and words in str(info.value), str(info.value)
    assert info.value.exit_code == 2


def test_the_rank_vllm_is_given_fits_the_largest_adapter(tmp_path):
    make_adapter(tmp_path / "a", r=4)
    make_adapter(tmp_path / "b", r=12)
    adapters = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    args = check_lora(lora_spec(tmp_path, {"adapters": adapters}))
    assert args == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    spec = lora_spec(tmp_path, {"adapters": adapters, "max_lora_rank": 8})
    with pytest.raises(SpecError, match="rank 12 is more than model.lora.max_lora_rank") as info:
        check_lora(spec)
    assert info.value.key == "model.lora.adapters.b"
    with pytest.raises(SpecError, match="vLLM accepts one of") as info:
        check_lora(lora_spec(tmp_path, {"adapters": adapters, "max_lora_rank": 12}))
    assert info.value.key == "model.lora.max_lora_rank"
    # an id is vLLM's to resolve: no rank known, vLLM's default room for one
    ids = read_adapters(lora_spec(tmp_path, {"adapters": {"x": "org/adapter"}}).model.lora)
    assert ids[0].path == "org/adapter" and ids[0].rank is None
    assert engine_args(
        lora_spec(tmp_path, {"adapters": {"x": "org/adapter"}, "max_loras": 1}).model.lora, ids
    ) == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 16}


@pytest.mark.vllm
def test_a_row_picks_its_adapter_or_the_jobs(tmp_path):
    make_adapter(tmp_path / "a")
    make_adapter(tmp_path / "b")
    lora = {"adapters": {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}}
    picked = Adapters(lora_spec(tmp_path, {**lora, "adapter": "b"}, lora_column="adapter"))
    assert picked.pick(None)[0] == "b"  # null: the job's adapter
    name, request = picked.pick("a")
    assert name == "a" and request.lora_name == "a" and request.lora_int_id == 1
    assert request.lora_path == str((tmp_path / "a").resolve())
    with pytest.raises(ValueError) as info:
        picked.pick("c")
    assert str(info.value) == (
        "unknown LoRA adapter: 'c' in column 'adapter' is not one of model.lora.adapters (a, b)"
    )
    assert Adapters(lora_spec(tmp_path, lora, lora_column="adapter")).pick(None) == (None, None)


def test_validate_counts_rows_naming_no_adapter_and_refuses_a_bad_one_before_reading(tmp_path, models):
    from batchspec.run.validate import validate_job as validate

    make_adapter(tmp_path / "a")
    write_parquet(tmp_path / "in" / "s.parquet", {"prompt": ["x", "y", "z"], "adapter": ["a", None, "nope"]})
    raw = {
        "input": {
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "lora_column": "adapter",
        },
        "output": {"path": str(tmp_path / "out")},
        "model": {
            "target": str(MODELS / "target"),
            "engine": ENGINE,
            "lora": {"adapters": {"a": str(tmp_path / "a")}},
        },
    }
    report = validate(build_spec(raw))
    assert report.shards[0].rows == 3
    assert report.shards[0].bad_rows == {"unknown LoRA adapter": 1}
    raw["model"]["lora"]["adapters"]["a"] = str(tmp_path / "missing")
    with pytest.raises(SpecError) as info:
        validate(build_spec(raw))
    assert info.value.key == "model.lora.adapters.a"


def test_tune_candidates_and_distill_generation_keep_the_jobs_adapters(tmp_path):
    """tune measures each speculative config with the job's adapters (its rows route as the
    job's do); distill generates each row's text with the row's adapter, so the draft learns
    the outputs the job will verify."""
    from batchspec.distill.data import generation_key, generation_request
    from batchspec.io.reader import Row
    from batchspec.tune.search_space import candidate_spec

    make_adapter(tmp_path / "a")
    lora = {"adapters": {"a": str(tmp_path / "a")}, "adapter": "a"}
    spec = lora_spec(tmp_path, lora, lora_column="adapter")
    cand = candidate_spec(spec, {"method": "ngram", "num_speculative_tokens": 3}, 8)
    assert cand.model.lora == spec.model.lora and cand.input.lora_column == "adapter"
    rows = [Row("s", 0, "s/0", {}, prompt="x", lora="a"), Row("s", 1, "s/1", {}, prompt="y")]
    gen_spec, gen_rows = generation_request(spec, rows, logprobs=0)
    assert gen_spec.model.lora == spec.model.lora and [r.lora for r in gen_rows] == ["a", None]
    # generated text cached for one adapter set is never reused for another
    other = lora_spec(tmp_path, {**lora, "adapter": None}, lora_column="adapter")
    assert generation_key(spec, rows, 0) != generation_key(other, rows, 0)


# --------------------------------------------------------------------------- on the real engine

#: Prompts from code the target knows; each row names its adapter (None: the base model).
PROMPTS = [
    "def mean(values):\n    total = 0\n",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n",
    "for line in open(path):\n    line = line.strip()\n",
    "def read_config(path):\n    with open(path) as fh:\n",
    "if __name__ == '__main__':\n",
]
ADAPTER_OF_ROW = [
    "upper",
    None,
    "comment",
    "upper",
    None,
    "comment",
    "comment",
    "upper",
    None,
    None,
    "upper",
    "comment",
]
MODES = {"off": None, "draft": DRAFT, "ngram": NGRAM}
#: as examples/requests/lora.yaml has it, so that its test runs on these engines
LORA = {"adapters": {"upper": str(UPPER), "comment": str(COMMENT)}, "max_loras": 2}


def _write_rows(root):
    rows = [(f"r{i}", PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(ADAPTER_OF_ROW)]
    write_parquet(
        root / "in" / "rows.parquet",
        {
            "id": [r[0] for r in rows],
            "prompt": [r[1] for r in rows],
            "adapter": pa.array([r[2] for r in rows], pa.string()),
        },
    )


def _run(shared_engines, root, name, speculative, lora, **input_keys):
    job = write_job(
        root / f"{name}.yaml",
        input={
            "path": str(root / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            **input_keys,
        },
        output={"path": str(root / f"out-{name}")},
        model={"target": str(MODELS / "target"), "engine": ENGINE, **({"lora": lora} if lora else {})},
        speculative=speculative,
        sampling={"temperature": 0.0, "max_tokens": 24},
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log
    return {r["id"]: r for r in read_output(root / f"out-{name}").to_pylist()}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, shared_engines):
    """Per mode: the mixed run (per-row column), and a run of each adapter alone (job-wide)."""
    root = tmp_path_factory.mktemp("lora")
    _write_rows(root)
    runs = {"root": root, "base": _run(shared_engines, root, "base", None, None)}
    for mode, speculative in MODES.items():
        runs[mode] = {
            "mixed": _run(shared_engines, root, f"{mode}-mixed", speculative, LORA, lora_column="adapter"),
            **{
                name: _run(shared_engines, root, f"{mode}-{name}", speculative, {**LORA, "adapter": name})
                for name in LORA["adapters"]
            },
        }
    return runs


@pytest.mark.engine
@pytest.mark.parametrize("mode", list(MODES))
def test_interleaved_adapters_equal_each_adapter_alone(lora_runs, mode):
    mixed = lora_runs[mode]["mixed"]
    assert len(mixed) == len(ADAPTER_OF_ROW)
    for i, adapter in enumerate(ADAPTER_OF_ROW):
        row = mixed[f"r{i}"]
        assert row["error"] is None and row["lora_adapter"] == adapter, row
        alone = lora_runs["base"] if adapter is None else lora_runs[mode][adapter]
        assert row["generated_text"] == alone[f"r{i}"]["generated_text"], (i, adapter)
        assert alone[f"r{i}"]["lora_adapter"] == adapter
        if row["twin_of"] is not None:  # a repeated prompt: its twin ran with the same adapter
            assert mixed[row["twin_of"]]["lora_adapter"] == adapter
        elif mode != "off":
            assert row["spec_num_draft_tokens"] > 0  # speculation ran on adapter rows too
    texts = {
        a: [mixed[f"r{i}"]["generated_text"] for i, x in enumerate(ADAPTER_OF_ROW) if x == a]
        for a in ("upper", "comment", None)
    }
    # each adapter does what it was trained to, and the base model does not (tools/tiny_lora.py
    # holds a build to the same kind of figures on other prompts)
    mean = lambda score, xs: sum(map(score, xs)) / len(xs)  # noqa: E731
    assert mean(upper_share, texts["upper"]) >= 0.7, texts
    assert mean(comment_share, texts["comment"]) >= 0.6, texts
    assert mean(upper_share, texts[None]) <= 0.3 and mean(comment_share, texts[None]) <= 0.3, texts


@pytest.mark.engine
def test_report_gives_rows_and_acceptance_per_adapter_and_the_lineage_names_them(lora_runs):
    from batchspec.report.metrics import BASE_MODEL, build_report
    from batchspec.report.text import render_text

    report = build_report(str(lora_runs["root"] / "out-draft-mixed"))
    adapters = report["lora_adapters"]
    assert list(adapters) == ["comment", "upper", BASE_MODEL]
    for name, count in (("comment", 4), ("upper", 4), (BASE_MODEL, 4)):
        assert adapters[name]["rows"] == count and adapters[name]["errors"] == 0
        assert 0 <= adapters[name]["acceptance_rate"] <= 1
    assert (
        sum(a["spec_num_draft_tokens"] for a in adapters.values())
        == report["overall"]["spec_num_draft_tokens"]
    )
    assert report["lineage"]["lora_adapters"] == [f"upper={UPPER}, comment={COMMENT}"]
    text = render_text(report)
    assert "Per LoRA adapter" in text and BASE_MODEL in text
    # a job without adapters has no such table
    assert build_report(str(lora_runs["root"] / "out-base"))["lora_adapters"] == {}


@pytest.mark.engine
def test_a_row_naming_no_adapter_is_an_error_row_and_the_rest_run(tmp_path, shared_engines):
    write_parquet(
        tmp_path / "in" / "rows.parquet",
        {"id": ["ok", "bad"], "prompt": PROMPTS[:2], "adapter": pa.array(["upper", "upperr"], pa.string())},
    )
    rows = _run(shared_engines, tmp_path, "bad", None, LORA, lora_column="adapter")
    assert rows["ok"]["error"] is None and rows["ok"]["lora_adapter"] == "upper"
    assert rows["bad"]["finish_reason"] == "error" and rows["bad"]["generated_text"] is None
    assert "'upperr' in column 'adapter'" in rows["bad"]["error"]


@pytest.mark.vllm
def test_cpu_lora_kernels_give_a_token_without_an_adapter_no_lora_term():
    """The plugin's kernels (batchspec.engine.cpu_plugin, fix 3) against the sum they stand for:
    vLLM's own read index -1 as the last adapter."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from batchspec.engine import cpu_plugin

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    a = torch.randn(2, 1, 4, 16, generator=gen)  # two adapters' A, rank 4
    b = torch.randn(2, 1, 8, 4, generator=gen)  # and B, 8 outputs
    indices = torch.tensor([-1, 0, 1])
    expected = torch.stack([torch.zeros(8)] + [b[i, 0] @ (a[i, 0] @ x[t]) for t, i in ((1, 0), (2, 1))])
    shrunk = torch.zeros(3, 4)
    cpu_plugin.bgmv_shrink(x, a, shrunk, indices, 1.0)
    out = torch.ones(3, 8)
    cpu_plugin.bgmv_expand(shrunk, b, out, indices, add_inputs=True)
    torch.testing.assert_close(out, 1 + expected)
    sliced = torch.ones(3, 12)
    cpu_plugin.bgmv_expand_slice(shrunk, b, sliced, indices, 2, 8, add_inputs=True)
    torch.testing.assert_close(sliced[:, 2:10], 1 + expected)
    assert torch.equal(sliced[:, :2], torch.ones(3, 2)) and torch.equal(sliced[:, 10:], torch.ones(3, 2))
    # what vLLM's own kernel does with the base-model token: the last adapter's term (read from
    # its file: in a process that started an engine, the module's names are the plugin's)
    original = importlib.util.spec_from_file_location("vllm_lora_ops_as_shipped", lora_ops.__file__)
    shipped = importlib.util.module_from_spec(original)
    original.loader.exec_module(shipped)
    assert shipped.bgmv_shrink is not cpu_plugin.bgmv_shrink
    theirs = torch.zeros(3, 4)
    shipped.bgmv_shrink(x, a, theirs, indices, 1.0)
    assert not torch.allclose(theirs[0], torch.zeros(4))


@pytest.mark.vllm
def test_base_rows_with_adapter_rows_are_refused_where_the_plugin_is_off(tmp_path, monkeypatch):
    from batchspec.engine import cpu_plugin

    make_adapter(tmp_path / "a")
    monkeypatch.setattr(cpu_plugin, "active", lambda: False)
    lora = {"adapters": {"a": str(tmp_path / "a")}}
    with pytest.raises(SpecError, match="CPU build runs a base-model row") as info:
        check_lora(lora_spec(tmp_path, lora, lora_column="adapter"))
    assert info.value.key == "input.lora_column"
    # every row with an adapter (null cells: the job's), or no per-row choice: nothing to mix
    assert check_lora(lora_spec(tmp_path, {**lora, "adapter": "a"}, lora_column="adapter"))
    assert check_lora(lora_spec(tmp_path, {**lora, "adapter": "a"}))
