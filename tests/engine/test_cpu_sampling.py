"""Sampled speculative decoding and seeded rows on vLLM's CPU build, with batchspec's vLLM plugin
(batchspec/engine/cpu_plugin.py; the bugs it works around: docs/vllm-cpu-rejection-sampler.md).

The engine tests call ``vllm.LLM`` directly (``probe``) on the session's shared engines
(tests/helpers/shared_engines.py: built as batchspec builds them), one without speculation, one
with a draft model, one with n-gram lookup and one with the EAGLE-3 head (the rejection sampler's
fix covers a head's proposals too); each engine serves every check, and the jobs of other test
files with the same model, engine arguments and speculation. Run pytest with
BATCHSPEC_DISABLE_VLLM_PLUGIN=1 to watch them fail without the plugin.
"""

from __future__ import annotations

import pytest
from helpers.jobs import DRAFT, ENGINE, HEAD, MODELS, NGRAM, read_output, write_job, write_parquet

from batchspec.engine import cpu_plugin as vllm_plugin
from batchspec.spec.load import load_spec

SAMPLED = {"temperature": 0.8, "top_p": 0.95}
#: Greedy rows batched with as many sampled rows, tokens each.
BATCH_ROWS, BATCH_TOKENS = 16, 24
#: Seeded samples of one prompt per engine and the tokens compared (2nd to 6th).
DIST_SAMPLES, DIST_POSITIONS = 400, range(1, 6)
#: Seeded rows of long prompts all in flight at once: more prompt tokens than one engine step
#: takes, so prompts are split over steps (chunked prefill). Alone, they go in waves whose
#: prompts take at most half of one step's token budget, so that none is split.
SEEDED_ROWS, SEEDED_PROMPT_TOKENS, SEEDED_TOKENS = 48, 109, 16
#: Below this the spec-on and spec-off samples are taken to come from different distributions.
MIN_P_VALUE = 0.01
#: The prompt of the distribution test: code in the style the tiny models learnt, which repeats
#: itself, so that n-gram lookup keeps proposing and the rejection sampler runs for the n-gram
#: method too (the draft model proposes on any prompt).
DIST_PROMPT = (
    "class Codec(codecs.Codec):\n"
    "    def encode(self, input, errors='strict'):\n"
    "        return codecs.charmap_encode(input, errors, encoding_table)\n\n"
    "    def decode(self, input, errors='strict'):\n"
    "        return codecs.charmap_decode(input, errors, decoding_table)\n\n"
    "class IncrementalEncoder(codecs.IncrementalEncoder):\n"
    "    def encode(self, input, final=False):\n"
)


# ---------------------------------------------------------------------------------- fast tests


def _reference_expand(values, ends, replace_from, replace_to):
    """What vLLM's Triton expand_kernel computes, written out one request at a time."""
    out, start = [], 0
    for value, end in zip(values, ends, strict=True):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


@pytest.mark.vllm
@pytest.mark.parametrize(
    "dtype, values, replace",
    [
        ("float32", [0.8, 0.0, 1.3, 0.0], (0, 1)),  # temperature: greedy rows divide by 1
        ("int32", [50, 0, 7, 1000], (0, 0)),  # top_k
        ("float32", [0.95, 1.0, 0.5, 0.9], (0, 0)),  # top_p
    ],
)
def test_expand_kernel_matches_the_triton_kernel(dtype, values, replace):
    torch = pytest.importorskip("torch")
    ends = [2, 2, 7, 12]  # the second request has no draft tokens
    x = torch.tensor(values, dtype=getattr(torch, dtype))
    cu = torch.tensor(ends, dtype=torch.int32)
    out = torch.full((ends[-1],), -7, dtype=x.dtype)
    vllm_plugin.expand_kernel_impl(out, x, cu, *replace, MAX_NUM_TOKENS=128)
    assert out.dtype == x.dtype
    assert out.tolist() == pytest.approx(_reference_expand(x.tolist(), ends, *replace))


def _vllm_cpu_expand_kernel():
    """vLLM's own CPU wrapper, from its source file (this process may have the plugin loaded)."""
    import importlib.util

    pytest.importorskip("vllm")
    spec = importlib.util.find_spec("vllm.utils.cpu_triton_utils")
    module_spec = importlib.util.spec_from_file_location("_vllm_cpu_triton_utils", spec.origin)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module._expand_kernel_impl


@pytest.mark.vllm
def test_vllm_cpu_expand_kernel_leaves_float_output_unwritten():
    """The bug itself, on the installed vLLM: the CPU wrapper writes into an int64 copy of the
    output and drops it. Fails (and the plugin's version gate needs updating) once vLLM fixes it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if vllm_plugin.inactive_reason() is not None and not vllm_plugin._disabled_by_env():
        pytest.skip(f"plugin not applicable here: {vllm_plugin.inactive_reason()}")
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    expand = _vllm_cpu_expand_kernel()
    out = torch.full((5,), -7.0)
    expand(out, torch.tensor([0.8, 0.0]), torch.tensor([2, 5], dtype=torch.int32), 0, 1)
    assert out.tolist() == [-7.0] * 5, "vLLM's CPU expand kernel now writes its output: drop the fix"


@pytest.mark.vllm
def test_plugin_active_only_where_checked(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    monkeypatch.delenv(vllm_plugin.DISABLE_ENV, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_plugin.active() == current_platform.is_cpu(), vllm_plugin.inactive_reason()
    monkeypatch.setenv(vllm_plugin.DISABLE_ENV, "1")
    assert not vllm_plugin.active()
    assert vllm_plugin.DISABLE_ENV in vllm_plugin.inactive_reason()
    monkeypatch.delenv(vllm_plugin.DISABLE_ENV)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert "VLLM_PLUGINS" in vllm_plugin.inactive_reason()
    monkeypatch.setenv("VLLM_PLUGINS", f"lora_filesystem_resolver,{vllm_plugin.PLUGIN_NAME}")
    assert vllm_plugin.active() == current_platform.is_cpu()
    monkeypatch.setattr(vllm_plugin, "CHECKED_VLLM_VERSIONS", frozenset({"0.0.1"}))
    assert "not a version the fixes were checked against" in vllm_plugin.inactive_reason()


@pytest.mark.vllm
def test_plugin_is_a_no_op_on_unchecked_versions(monkeypatch, caplog):
    pytest.importorskip("vllm")
    from vllm.utils import cpu_triton_utils

    monkeypatch.delenv(vllm_plugin.DISABLE_ENV, raising=False)
    monkeypatch.setattr(vllm_plugin, "CHECKED_VLLM_VERSIONS", frozenset({"0.0.1"}))
    monkeypatch.setattr(vllm_plugin, "_applied", set())
    before = cpu_triton_utils._expand_kernel_impl
    with caplog.at_level("DEBUG", logger=vllm_plugin.__name__):
        vllm_plugin.register()
    assert cpu_triton_utils._expand_kernel_impl is before
    assert "does nothing" in caplog.text and "0.0.1" in caplog.text


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get(vllm_plugin.PLUGIN_NAME) == vllm_plugin.PLUGIN_TARGET, found


class _Proxy:
    """Like Flask's ``request``: every attribute read outside a request raises."""

    __slots__ = ()

    @property
    def __dict__(self):
        raise RuntimeError("Working outside of request context.")


class _Lib:
    """Like ``llvmlite.binding.ffi.lib``: every attribute is a function wrapper, ``__dict__`` too."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *args: None


@pytest.mark.vllm
def test_kernel_overrides_register_beside_values_vllms_scan_cannot_read(monkeypatch):
    """Fix 4: vLLM's kernel rebind scan over every module's values raises on a proxy that raises
    and on a ``__dict__`` that is no mapping (a second engine in one process then fails to
    start); with the fix they are out of their module meanwhile, and back afterwards."""
    pytest.importorskip("vllm")
    import sys
    import types

    from vllm.triton_utils import dispatcher

    module = types.ModuleType("batchspec_test_unscannable")
    module.request, module.lib, module.plain = _Proxy(), _Lib(), {"kept": 1}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original, wrapper = object(), object()
    for value in (_Proxy(), _Lib()):
        module.value = value
        with pytest.raises((RuntimeError, AttributeError)):
            dispatcher._rebind_kernels([(original, wrapper)])
    del module.value
    with vllm_plugin._unscannable_values_hidden():
        assert not hasattr(module, "request") and not hasattr(module, "lib")
        assert module.plain == {"kept": 1}
        dispatcher._rebind_kernels([(original, wrapper)])
    assert isinstance(vars(module)["request"], _Proxy) and isinstance(vars(module)["lib"], _Lib)


@pytest.mark.vllm
def test_refusal_follows_the_plugin(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from batchspec.engine.checks import refuses_random_sampling
    from batchspec.spec.load import load_spec

    job = write_job(
        tmp_path / "j.yaml",
        input={"path": str(tmp_path / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        speculative=DRAFT,
        sampling=SAMPLED,
    )
    spec = load_spec(job)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(vllm_plugin.DISABLE_ENV, raising=False)
    assert not refuses_random_sampling(spec)  # the plugin fixes the CPU build; others are fine
    monkeypatch.setenv(vllm_plugin.DISABLE_ENV, "1")
    assert refuses_random_sampling(spec) == current_platform.is_cpu()


def permutation_p_value(
    a: list[list[int]], b: list[list[int]], positions, permutations: int = 1999, seed: int = 0
) -> float:
    """p-value of "samples a and b come from one distribution": chi-square statistic of the
    token counts at each position, summed over positions, against random relabellings of the
    pooled samples (whole sequences move, so positions may depend on each other)."""
    import numpy as np

    def tokens(sample: list[int]) -> list[int]:
        return [sample[p] if p < len(sample) else -1 for p in positions]  # -1: ended earlier

    pooled = np.array([tokens(s) for s in a + b])
    is_a = np.zeros(len(pooled), bool)
    is_a[: len(a)] = True

    def statistic(mask) -> float:
        total = 0.0
        for col in pooled.T:
            values, codes = np.unique(col, return_inverse=True)
            counts_a = np.bincount(codes[mask], minlength=len(values))
            counts_b = np.bincount(codes[~mask], minlength=len(values))
            both = counts_a + counts_b
            exp_a = both * mask.sum() / len(mask)
            exp_b = both - exp_a
            total += (((counts_a - exp_a) ** 2) / exp_a + ((counts_b - exp_b) ** 2) / exp_b).sum()
        return total

    observed = statistic(is_a)
    rng = np.random.default_rng(seed)
    at_least = sum(statistic(rng.permutation(is_a)) >= observed for _ in range(permutations))
    return (1 + at_least) / (1 + permutations)


@pytest.mark.vllm
def test_permutation_test_tells_distributions_apart():
    import numpy as np

    rng = np.random.default_rng(1)
    same_a = rng.integers(0, 5, (200, 6)).tolist()
    same_b = rng.integers(0, 5, (200, 6)).tolist()
    shifted = rng.choice(5, (200, 6), p=[0.3, 0.3, 0.2, 0.1, 0.1]).tolist()
    assert permutation_p_value(same_a, same_b, range(1, 6), permutations=499) > 0.05
    assert permutation_p_value(same_a, shifted, range(1, 6), permutations=499) < 0.01


# ---------------------------------------------------------------------------------- the probe


def probe(llm, config: dict) -> dict:
    """Run every check's requests on one engine (a ``vllm.LLM``); returns the results."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from batchspec.engine import cpu_plugin as vllm_plugin

    result: dict = {
        "plugin_active": vllm_plugin.active(),
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
    }

    def generate(prompts: list[list[int]], params: list) -> tuple[list, int]:
        """The completions, in prompt order, and the draft tokens proposed for them."""
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        drafted = 0
        for o in outputs:
            metrics = getattr(o.outputs[0], "spec_decode_metrics", None)
            drafted += metrics.to_dict()["num_draft_tokens"] if metrics is not None else 0
        return [o.outputs[0] for o in outputs], drafted

    def token_ids(completions: list) -> list[list[int]]:
        return [list(c.token_ids) for c in completions]

    # (a) greedy rows interleaved with sampled rows, all in one batch
    batch = config["batch_prompts"]
    greedy = SamplingParams(temperature=0.0, max_tokens=BATCH_TOKENS)
    sampled = SamplingParams(**SAMPLED, max_tokens=BATCH_TOKENS)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(batch))]
    outputs, result["batch_drafted"] = generate(batch, params)
    result["batch_greedy"] = [list(o.token_ids) for o in outputs[0::2]]
    result["batch_greedy_text"] = [o.text for o in outputs[0::2]]

    # (b) seeded samples of one prompt, in waves whose prompts fit in one engine step: no prompt
    # is split, so this part does not depend on the chunked-prefill fix
    samples, result["dist_drafted"] = [], 0
    wave = result["max_num_batched_tokens"] // len(config["dist_prompt"])
    for start in range(0, DIST_SAMPLES, wave):
        seeds = range(start, min(start + wave, DIST_SAMPLES))
        got, drafted = generate(
            [config["dist_prompt"]] * len(seeds),
            [
                SamplingParams(**SAMPLED, seed=config["dist_seed"] + s, max_tokens=max(DIST_POSITIONS) + 1)
                for s in seeds
            ],
        )
        samples += token_ids(got)
        result["dist_drafted"] += drafted
    result["dist_samples"] = samples

    # (c) seeded long prompts: a few at a time (no prompt split), then all at once (split)
    seeded = config["seeded_prompts"]
    seeded_params = [
        SamplingParams(**SAMPLED, seed=1000 + i, max_tokens=SEEDED_TOKENS) for i in range(len(seeded))
    ]
    alone, wave = [], max(1, result["max_num_batched_tokens"] // (2 * SEEDED_PROMPT_TOKENS))
    result["seeded_wave"] = wave
    for start in range(0, len(seeded), wave):
        alone += token_ids(generate(seeded[start : start + wave], seeded_params[start : start + wave])[0])
    result["seeded_alone"] = alone
    try:
        result["seeded_together"] = token_ids(generate(seeded, seeded_params)[0])
    except Exception as exc:  # the bug kills the engine: record it for the test to report
        result["seeded_error"] = f"{type(exc).__name__}: {exc}"
    return result


def _prompts() -> dict:
    """Prompts for the probe (token ids) and the job test (text), from the demo prompt set."""
    from demo_data import prompt_table
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    snippets = prompt_table(2 * BATCH_ROWS + 160, seed=11)["prompt"].to_pylist()
    batch = [tokenizer.encode(s) for s in snippets[: 2 * BATCH_ROWS]]
    stream = [t for s in snippets[2 * BATCH_ROWS :] for t in tokenizer.encode(s, add_special_tokens=False)]
    n = SEEDED_PROMPT_TOKENS
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    seeded = [bos + stream[i * n : (i + 1) * n - len(bos)] for i in range(SEEDED_ROWS)]
    assert all(len(p) == n for p in seeded), "not enough prompt text for the seeded rows"
    return {
        "batch_text": snippets[: 2 * BATCH_ROWS],
        "batch_prompts": batch,
        "seeded_prompts": seeded,
        "dist_prompt": tokenizer.encode(DIST_PROMPT),
    }


def run_probe(shared_engines, speculative: dict | None, dist_seed: int) -> dict:
    """Run :func:`probe` on the session's shared engine for the tiny target and ``speculative``.

    ``dist_seed`` is the first seed of the distribution samples: each engine gets its own, or
    samples that drew no drafts would be the same on both sides and make them look alike."""
    spec = shared_engines.probe_spec(MODELS / "target", ENGINE, speculative)
    config = {"dist_seed": dist_seed, **_prompts()}
    result = probe(shared_engines.engine(spec).llm, config)
    if "seeded_error" in result:
        shared_engines.release(spec)  # the engine died: no later test may use it
    result["log"] = "(the engine's own output: pytest's captured stderr)"
    return result


@pytest.fixture(scope="module")
def spec_off(shared_engines) -> dict:
    return run_probe(shared_engines, None, dist_seed=0)


@pytest.fixture(scope="module", params=["draft_model", "ngram", "eagle3"])
def spec_on(request, shared_engines) -> tuple[str, dict]:
    method = request.param
    config, dist_seed = {"draft_model": (DRAFT, 10_000), "ngram": (NGRAM, 20_000), "eagle3": (HEAD, 30_000)}[
        method
    ]
    return method, run_probe(shared_engines, config, dist_seed)


# ---------------------------------------------------------------------------------- engine tests


@pytest.mark.engine
def test_greedy_rows_batched_with_sampled_rows_equal_speculation_off(spec_off, spec_on):
    method, on = spec_on
    assert on["batch_drafted"] > 0, f"{method} proposed nothing: the rejection sampler never ran"
    equal = [a == b for a, b in zip(on["batch_greedy"], spec_off["batch_greedy"], strict=True)]
    assert all(equal), (
        f"{method}: {sum(equal)}/{len(equal)} greedy rows equal speculation off "
        f"(plugin active: {on['plugin_active']})"
    )


@pytest.mark.engine
def test_sampled_distribution_equals_speculation_off(spec_off, spec_on):
    method, on = spec_on
    # most samples must have had drafts at the compared positions, or nothing was tested
    assert on["dist_drafted"] >= DIST_SAMPLES * len(DIST_POSITIONS) // 2, on["dist_drafted"]
    p = permutation_p_value(on["dist_samples"], spec_off["dist_samples"], DIST_POSITIONS)
    print(f"{method}: permutation p-value {p:.4f} (plugin active: {on['plugin_active']})")
    assert p >= MIN_P_VALUE, (
        f"{method}: seeded samples with speculation differ from speculation "
        f"off (p={p:.4f}; plugin active: {on['plugin_active']})"
    )


@pytest.mark.engine
@pytest.mark.parametrize("which", ["off", "on"])
def test_seeded_rows_survive_chunked_prefill_and_keep_their_seed(which, spec_off, spec_on):
    method, on = spec_on
    if which == "off" and method == "ngram":
        pytest.skip("speculation off: checked once")
    result = spec_off if which == "off" else on
    # all rows in flight at once hold more prompt tokens than one step takes: prompts are split;
    # alone, they went in waves (more than one), each wave's prompts in one step
    assert SEEDED_ROWS * SEEDED_PROMPT_TOKENS > result["max_num_batched_tokens"]
    assert result["seeded_wave"] < SEEDED_ROWS
    assert result["seeded_wave"] * SEEDED_PROMPT_TOKENS <= result["max_num_batched_tokens"]
    assert "seeded_error" not in result, result["seeded_error"] + "\n" + result["log"]
    # a seed gives the same tokens however the scheduler split the prompts
    same = [a == b for a, b in zip(result["seeded_together"], result["seeded_alone"], strict=True)]
    assert all(same), f"{sum(same)}/{len(same)} seeded rows kept their tokens under chunked prefill"


@pytest.mark.engine
def test_job_with_sampling_and_speculation_runs(tmp_path, spec_off, shared_engines):
    """The user's path: a job with temperature 0.8 / top_p 0.95 and speculation on (refused on
    the CPU build before the plugin), per-row seeds on long prompts all in flight, and greedy
    rows among them."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    prompts = _prompts()
    greedy = prompts["batch_text"][0::2]
    # rows s2k and s2k+1 share a prompt and a seed: reproducibility shows within one run
    long_rows = [
        tokenizer.decode(prompts["seeded_prompts"][i - i % 2], skip_special_tokens=True)
        for i in range(SEEDED_ROWS)
    ]
    ids = [f"g{i}" for i in range(len(greedy))] + [f"s{i}" for i in range(SEEDED_ROWS)]
    write_parquet(
        tmp_path / "in" / "part-0.parquet",
        {
            "id": ids,
            "prompt": greedy + long_rows,
            "temperature": pa.array([0.0] * len(greedy) + [None] * SEEDED_ROWS, pa.float64()),
            "max_tokens": pa.array([BATCH_TOKENS] * len(greedy) + [None] * SEEDED_ROWS, pa.int64()),
            "seed": pa.array([None] * len(greedy) + [i // 2 for i in range(SEEDED_ROWS)], pa.int64()),
        },
    )
    job = write_job(
        tmp_path / "hot.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_columns": {"temperature": "temperature", "max_tokens": "max_tokens", "seed": "seed"},
        },
        output={"path": str(tmp_path / "out")},
        speculative=DRAFT,
        sampling={**SAMPLED, "max_tokens": SEEDED_TOKENS},
        # each seeded pair generated twice, not once for both (batchspec/run/twins.py)
        execution={"dedupe_window": 0},
    )
    run = shared_engines.run(load_spec(job))
    assert run.exit_code == 0, run.log[-3000:]
    rows = {r["request_id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert set(rows) == set(ids)
    for r in rows.values():
        assert r["error"] is None and r["finish_reason"] in ("stop", "length"), r
        if r["num_output_tokens"] > 1:  # at least one verification step
            assert r["spec_num_draft_tokens"] > 0, r
    for i in range(0, SEEDED_ROWS, 2):
        assert rows[f"s{i}"]["generated_text"] == rows[f"s{i + 1}"]["generated_text"], i
    # greedy rows batched with the sampled ones: what bare vLLM gives without speculation
    for i, (tokens, text) in enumerate(
        zip(spec_off["batch_greedy"], spec_off["batch_greedy_text"], strict=True)
    ):
        assert rows[f"g{i}"]["num_output_tokens"] == len(tokens), i
        assert rows[f"g{i}"]["generated_text"] == text, i
