"""Parallel drafts (``batchspec distill --method pard``; batchspec/distill/pard.py): the training
batch's layout and the validation figure stepped as vLLM steps, without an engine; the mask token
chosen or refused before any work; and, on the real engine, a parallel draft distilled from the
tiny draft, gated against that draft drafting in parallel, installed with its mask token, and run
by `batchspec run` with greedy text equal to speculation off and its acceptance in the columns.

Engine time: about 4 minutes (distill's generation and two evaluations, two runs, and a tune of
off and the draft and parallel draft at k=3)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest
from domain_data import write_shards
from helpers.jobs import DRAFT, ENGINE, MODELS, read_output, run_cli, run_cli_in_process, write_job

from batchspec.distill.options import DistillOptions
from batchspec.distill.pard import ParallelObjective, choose_mask_token, parallel_acceptance
from batchspec.distill.session import check_options
from batchspec.distill.train import Example, _steps
from batchspec.errors import SpecError
from batchspec.spec.load import load_spec
from batchspec.spec.methods import detect, vllm_speculative

K = 3
MASK = 0


def _example(tokens: list[int], prompt_len: int) -> Example:
    import torch

    return Example(torch.tensor(tokens, dtype=torch.long), prompt_len)


@pytest.mark.vllm  # torch
def test_the_batch_puts_k_minus_1_masks_after_a_drawn_point_and_labels_the_tokens_after_it():
    import torch

    ex = _example([5, 6, 7, 10, 11, 12, 13, 14], prompt_len=3)  # prompt 5 6 7, window 10..14
    objective = ParallelObjective(k=K, mask=MASK)
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        ids, attn, labels, teacher, weight = objective.batch([ex], [0], pad_id=1, topk=False, gen=gen)
        row, lab, w = ids[0].tolist(), labels[0].tolist(), weight[0]
        n = int(attn[0].sum())
        point = n - (K - 1)  # the drawn point: the real tokens before it, then the masks
        seen.add(point)
        assert 3 <= point <= 7 and teacher is None
        assert row[:point] == ex.tokens[:point].tolist() and row[point:n] == [MASK] * (K - 1)
        # the next token at each real position from the prompt's last on, the tokens after it at the masks
        tokens = ex.tokens.tolist()
        want = (
            [-100] * 2
            + tokens[3 : point + 1]
            + [tokens[p] if p < 8 else -100 for p in range(point + 1, point + K)]
        )
        assert lab[:n] == want
        masked = [lab[i] != -100 for i in range(point, n)]
        # half the loss on the next tokens, half on the masks' (where any is labelled)
        assert abs(float(w[:point].sum()) - (0.5 if any(masked) else 1.0)) < 1e-6
        assert abs(float(w.sum()) - 1.0) < 1e-6
    assert seen == {3, 4, 5, 6, 7}  # every point of the window is drawn


class _Rule:
    """A stand-in draft over sequences where each token is the one before plus 1: it proposes
    the rule's tokens at the masks (``masks_right``) or something else there, and always the
    rule's next token after a real one."""

    def __init__(self, vocab: int, masks_right: bool):
        self.vocab, self.masks_right, self.training = vocab, masks_right, True
        self.model, self.lm_head = self, lambda hidden: hidden

    def train(self, mode: bool = True):
        self.training = mode

    def eval(self):
        self.training = False

    def __call__(self, input_ids):
        import torch

        batch, width = input_ids.shape
        out = torch.zeros((batch, width, self.vocab))
        for b in range(batch):
            ids = input_ids[b].tolist()
            last = max((i for i, t in enumerate(ids) if t != MASK), default=0)
            for q in range(width):
                if q <= last:
                    nxt = (ids[q] + 1) % self.vocab
                else:
                    nxt = (ids[last] + q - last + 1) % self.vocab if self.masks_right else 1
                out[b, q, nxt] = 1.0
        return type("Out", (), {"last_hidden_state": out})


@pytest.mark.vllm  # torch
def test_parallel_acceptance_steps_as_vllm_does():
    windows = [_example(list(range(2, 2 + 3 + n)), prompt_len=3) for n in (7, 10, 1)]
    for right, hits in ((True, True), (False, None)):
        got = parallel_acceptance(_Rule(64, right), windows, K, MASK)
        if hits:  # every proposal right: greedy speculation's steps over all-matching windows
            accepted = proposed = 0
            for n in (7, 10, 1):
                a, p = _steps([True] * n, K)
                accepted, proposed = accepted + a, proposed + p
            assert got == pytest.approx(accepted / proposed)
        else:  # only the first proposal of a step right: one accepted, then the target's token
            steps = sum(-(-n // 2) for n in (7, 10, 1))
            accepted = sum(n // 2 + n % 2 for n in (7, 10, 1))
            assert got == pytest.approx(accepted / (steps * K))


def test_the_mask_token_is_the_one_given_the_drafts_own_or_the_pad_token():
    special = {"pad": 0, "bos": 1, "eos": 2}
    assert choose_mask_token({}, 2048, special, None) == 0
    assert choose_mask_token({"pard_token": 7}, 2048, special, None) == 7
    assert choose_mask_token({"pard_token": 7}, 2048, special, 9) == 9
    for special_, given, words in (
        ({"pad": 2, "bos": 1, "eos": 2}, None, "no pad token"),
        ({"pad": None, "bos": 1, "eos": 2}, None, "no pad token"),
        (special, 2048, "not a token id"),
        (special, -1, "not a token id"),
    ):
        with pytest.raises(SpecError, match=words) as err:
            choose_mask_token({}, 2048, special_, given)
        assert err.value.key == "--mask-token"


def test_a_config_naming_a_mask_token_is_a_parallel_draft_and_vllm_gets_draft_model_in_parallel():
    assert detect({"architectures": ["LlamaForCausalLM"], "pard_token": 0}) == "pard"
    assert detect({"architectures": ["LlamaForCausalLM"], "mask_token_id": 5}) == "pard"
    assert detect({"architectures": ["LlamaForCausalLM"], "pard_token": True}) == "draft_model"
    assert detect({"architectures": ["LlamaForCausalLM"]}) == "draft_model"
    section = {"method": "pard", "model": "d", "num_speculative_tokens": 3}
    assert vllm_speculative(section) == {**section, "method": "draft_model", "parallel_drafting": True}
    assert vllm_speculative({**DRAFT}) == DRAFT


#: The tiny draft at k=3, a job's default section.
SEQUENTIAL = {**DRAFT, "num_speculative_tokens": K}


def _job(tmp: Path, speculative: dict | None = SEQUENTIAL, rows: int = 48) -> Path:
    """A job over two shards of prompts like the tiny models' (None: speculation off)."""
    write_shards(tmp / "prompts", rows=rows, shards=2, seed=5)
    return write_job(
        tmp / "job.yaml",
        input={"path": str(tmp / "prompts" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp / "out")},
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        **({"speculative": speculative} if speculative is not None else {}),
    )


def test_mask_options_are_refused_before_any_work(tmp_path, models):
    spec = load_spec(_job(tmp_path))
    for method in ("draft_model", "eagle3"):
        opts = DistillOptions(out=tmp_path / "d", method=method, draft=None, mask_token=3, force=True)
        with pytest.raises(SpecError) as err:
            check_options(spec, opts)
        assert err.value.key == "--mask-token"
    opts = DistillOptions(out=tmp_path / "d", method="pard", draft=str(models / "draft"), mask_token=5000)
    with pytest.raises(SpecError, match="not a token id") as err:
        check_options(spec, opts)
    assert err.value.key == "--mask-token"


def test_a_parallel_draft_whose_config_names_no_mask_token_exits_2_at_validate(tmp_path, models):
    job = _job(tmp_path, {"method": "pard", "model": str(models / "draft"), "num_speculative_tokens": K})
    done = run_cli_in_process("validate", str(job))
    assert done.returncode == 2, done.stderr
    assert "speculative.model" in done.stderr and "mask token" in done.stderr


@pytest.fixture(scope="module")
def parallel(tmp_path_factory, models):
    """A parallel draft distilled from the tiny draft on a job's own prompts (the gate on)."""
    tmp = tmp_path_factory.mktemp("pard")
    job = _job(tmp)
    out = tmp / "parallel-draft"
    done = run_cli(
        "distill", str(job), "--method", "pard", "--draft", str(models / "draft"), "--out", str(out),
        "--sample", "48", "--holdout", "12", "--steps", "60", "--batch-size", "8", "--json",
    )  # fmt: skip
    return tmp, job, out, done


@pytest.mark.engine
def test_distill_trains_gates_and_installs_a_parallel_draft_that_runs_with_greedy_text_equal_to_off(
    parallel, models
):
    tmp, job, out, done = parallel
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    decision = result["decision"]
    # judged against the starting draft drafting in parallel with the same mask token (untrained for it)
    assert "judged drafting in parallel: mask token 0" in done.stderr
    assert decision["install"] and not decision["forced"], decision
    assert decision["gain"] > decision["margin"] > 0
    assert result["after"]["acceptance_rate"] > result["before"]["acceptance_rate"]
    config = json.loads((out / "config.json").read_text())
    assert config["pard_token"] == 0 and config["num_hidden_layers"] == 1
    card = json.loads((out / "batchspec-model.json").read_text())
    assert card["method"] == "pard" and card["role"] == "draft"

    # run by its checkpoint alone (no method: the config says pard), then with speculation off
    runs = {}
    for name, speculative in (("pard", {"model": str(out), "num_speculative_tokens": K}), ("off", None)):
        ran = run_cli("run", str(_job(tmp / name, speculative, rows=24)))
        assert ran.returncode == 0, ran.stderr[-3000:]
        runs[name] = read_output(tmp / name / "out").sort_by("id")
    assert (
        runs["pard"].column("generated_text").to_pylist() == runs["off"].column("generated_text").to_pylist()
    )
    drafted = runs["pard"].column("spec_num_draft_tokens")
    accepted = runs["pard"].column("spec_num_accepted_tokens")
    assert pc.min(drafted).as_py() > 0 and pc.sum(accepted).as_py() > 0
    summary = json.loads(
        sorted((tmp / "pard" / "out" / "_batchspec" / "runs").glob("*.json"))[-1].read_text()
    )
    assert "pard" in json.dumps(summary)


def test_tune_weighs_a_parallel_draft_in_parallel_and_a_token_a_pass(tmp_path, models):
    import shutil

    from batchspec.spec.build import build_spec
    from batchspec.tune.search_space import candidates

    draft = Path(shutil.copytree(models / "draft", tmp_path / "fast"))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "pard_token": 0}))
    spec = load_spec(_job(tmp_path, None))
    _, families = candidates(spec, [str(draft), str(models / "draft")], [2, 3], ngram=False)
    methods = {name: [(c.k, c.speculative["method"]) for c in fam] for name, fam in families.items()}
    assert methods == {
        "pard:fast": [(2, "pard"), (3, "pard")],
        "fast": [(2, "draft_model"), (3, "draft_model")],
        "draft": [(2, "draft_model"), (3, "draft_model")],
    }
    # vLLM's own spelling is the same method
    raw = {
        **spec.raw,
        "speculative": {"method": "draft_model", "parallel_drafting": True, "model": str(draft)},
    }
    assert build_spec(raw).speculative == {"method": "pard", "model": str(draft)}


@pytest.mark.engine
def test_tune_measures_the_parallel_draft_beside_its_weights_drafting_a_token_a_pass(parallel):
    tmp, job, out, done = parallel
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = run_cli(
        "tune", str(job), "--sample", "8", "--concurrency", "1", "--k", str(K), "--no-ngram",
        "--no-batch-knobs", "--draft", str(out), "--json",
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    entries = {c["label"]: c for c in json.loads(tuned.stdout)["candidates"]}
    assert {"off", f"pard:{out.name} k={K}", f"{out.name} k={K}", f"draft k={K}"} <= set(entries)
    parallel_entry = entries[f"pard:{out.name} k={K}"]
    assert parallel_entry["speculative"]["method"] == "pard" and not parallel_entry["skipped"]
    assert parallel_entry["output_tokens_per_s"] > 0 and parallel_entry["mean_acceptance_length"] > 1
