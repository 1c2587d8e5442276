"""Distillation that generalises, without an engine: the sizing rule (how much of the target's
text for the steps and the model), the windows a continuation is cut into, the validation split
and its early stop with the best weights kept (a tiny torch model), the noise rule and the
install decision."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from batchspec.distill.data import (
    MAX_EPOCHS,
    MAX_WINDOWS,
    NEW_HEAD_WINDOWS,
    Sample,
    generation_request,
    plan_data,
    split_validation,
    supported_steps,
    validation_size,
)
from batchspec.distill.gate import MIN_MARGIN, NOISE_SE, decide, paired_gain
from batchspec.errors import NotInstalled

# --------------------------------------------------------------------------- sizing


def test_a_small_job_gets_continuations_of_the_job_s_length_and_fewer_steps():
    # 60 prompts x 32 tokens (1,920 tokens), 300 steps of 16, a 1.7M-parameter draft
    plan = plan_data(steps=300, batch_size=16, window=32, prompts=60, parameters=1_700_000)
    assert plan.wanted_tokens == max(300 * 16 * 32 // MAX_EPOCHS, math.ceil(1_700_000 / 32))
    # no longer tails (another distribution): the job's own max_tokens, however little data
    assert MAX_WINDOWS == 1 and plan.windows == 1 and plan.planned_tokens == 60 * 32
    # 60 windows support 60 steps of 16 at 16 passes each: not 300
    assert supported_steps(60, 16, 300) == 60 * MAX_EPOCHS // 16 == 60


def test_a_new_head_gets_longer_continuations_and_a_draft_or_a_continued_head_does_not(tmp_path):
    from batchspec.distill.options import DistillOptions
    from batchspec.distill.trainers import DRAFT_MODEL_TRAINER, EAGLE3_TRAINER, PARD_TRAINER

    # the 1.57M-parameter head on 72 prompts x 64 tokens (4,608): it wants 49,184
    plan = plan_data(300, 16, 64, 72, 1_573_888, NEW_HEAD_WINDOWS)
    assert NEW_HEAD_WINDOWS == 8 and plan.windows == 8 and plan.planned_tokens == 72 * 64 * 8
    assert plan_data(300, 16, 64, 72, 1_573_888).windows == 1
    new, continued = DistillOptions(out=tmp_path, method="eagle3"), DistillOptions(out=tmp_path, head="h")
    assert EAGLE3_TRAINER.max_windows(new) == NEW_HEAD_WINDOWS
    assert EAGLE3_TRAINER.max_windows(continued) == MAX_WINDOWS
    assert DRAFT_MODEL_TRAINER.max_windows(new) == PARD_TRAINER.max_windows(new) == MAX_WINDOWS


def test_enough_prompts_need_no_more_passes():
    # the benchmark's run: 1,200 prompts x 48 tokens for 200 steps of 16
    plan = plan_data(steps=200, batch_size=16, window=48, prompts=1200, parameters=1_700_000)
    assert plan.windows == 1
    assert supported_steps(1200, 16, 200) == 200


def test_a_bigger_model_asks_for_more_data():
    small = plan_data(steps=10, batch_size=4, window=16, prompts=100, parameters=100_000)
    large = plan_data(steps=10, batch_size=4, window=16, prompts=100, parameters=2_000_000)
    assert large.wanted_tokens > small.wanted_tokens == math.ceil(100_000 / 32)
    assert small.windows == large.windows == 1


@pytest.mark.parametrize(
    ("sample", "asked", "held"),
    [
        (400, None, 80),
        (200, None, 40),
        (1000, None, 200),
        (5000, None, 200),
        (4, None, 0),
        (400, 300, 200),
        (400, 10, 10),
        (400, 0, 0),
    ],
)
def test_the_held_out_share_leaves_a_small_job_most_of_its_prompts(sample, asked, held):
    from batchspec.distill.data import heldout_size

    assert heldout_size(sample, asked) == held


def test_a_job_too_small_is_told_so_with_the_numbers():
    from batchspec.distill.session import too_little_data

    small = Sample(train=[None] * 288, heldout=[None] * 80, population=400)
    msg = too_little_data(9216, 288, 53125, 32, small, 2000)
    assert "9216 target tokens to train on (288 prompts x about 32)" in msg
    assert "wants 53125, about 1661 prompts" in msg and "the job has 400 prompts in all" in msg
    big = Sample(train=[None] * 288, heldout=[None] * 80, population=50_000)
    assert "--sample, up to the job's 50000" in too_little_data(9216, 288, 53125, 32, big, 368)


def test_supported_steps_bounds():
    assert supported_steps(0, 16, 300) == 1
    assert supported_steps(10_000, 16, 300) == 300


def test_validation_split_is_taken_from_the_training_prompts():
    assert [validation_size(n) for n in (5, 10, 36, 1800, 5000)] == [0, 2, 3, 180, 200]
    rows = [SimpleNamespace(request_id=f"r{i}") for i in range(10)]
    sample = split_validation(Sample(train=rows, heldout=["h"], population=11), 3)
    assert [r.request_id for r in sample.validation] == ["r0", "r1", "r2"]
    assert [r.request_id for r in sample.train] == [f"r{i}" for i in range(3, 10)]
    assert sample.heldout == ["h"]
    assert len(split_validation(Sample(train=rows[:4], heldout=[], population=4), 9).validation) == 2


def test_longer_continuations_scale_the_job_s_and_each_row_s_max_tokens(tmp_path):
    from helpers.jobs import write_job

    from batchspec.io.reader import Row
    from batchspec.spec.load import load_spec

    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0, "max_tokens": 24},
    )
    spec = load_spec(job)
    rows = [
        Row("s", 0, "s/0", {}, prompt="a", overrides={"max_tokens": 5}),
        Row("s", 1, "s/1", {}, prompt="b"),
    ]
    gen, gen_rows = generation_request(spec, rows, 0, windows=3)
    assert gen.sampling["max_tokens"] == 72
    assert gen_rows[0].overrides == {"max_tokens": 15} and gen_rows[1] is rows[1]
    gen, gen_rows = generation_request(spec, rows, 0)
    assert gen.sampling["max_tokens"] == 24 and gen_rows == rows


# --------------------------------------------------------------------------- training


@pytest.mark.vllm
def test_a_continuation_is_cut_into_windows():
    from batchspec.distill.train import prepare_examples

    row = {
        "prompt_token_ids": [1, 2],
        "output_token_ids": [3, 4, 5, 6, 7],
        "topk_token_ids": [[3], [4], [5], [6], [7]],
        "topk_logprobs": [[-0.1]] * 5,
    }
    examples = prepare_examples([row], window=2)
    assert [ex.tokens.tolist() for ex in examples] == [
        [1, 2, 3, 4],
        [1, 2, 3, 4, 5, 6],
        [1, 2, 3, 4, 5, 6, 7],
    ]
    assert [ex.prompt_len for ex in examples] == [2, 4, 6]
    assert [ex.topk_ids[:, 0].tolist() for ex in examples] == [[3, 4], [5, 6], [7]]
    assert len(prepare_examples([row])) == 1  # no window: the whole continuation


def test_early_stop_keeps_the_best_and_stops_after_patience():
    from batchspec.distill.train import EarlyStop

    watch = EarlyStop(patience=2)
    assert watch.record(0, 0.30) and not watch.stop
    assert watch.record(10, 0.40)
    assert not watch.record(20, 0.40) and not watch.stop  # equal is not better
    assert not watch.record(30, 0.35) and watch.stop
    assert (watch.best, watch.best_step) == (0.40, 10)


VOCAB = 16


def _rows(n: int, shift: int, length: int = 12, seed: int = 0) -> list[dict]:
    """Sequences where each next token is the last + ``shift`` (mod VOCAB)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        seq = [rng.randrange(VOCAB)]
        for _ in range(length):
            seq.append((seq[-1] + shift) % VOCAB)
        rows.append({"prompt_token_ids": seq[:2], "output_token_ids": seq[2:]})
    return rows


def _bigram():
    import torch

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 16)
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, input_ids, attention_mask=None):
            return SimpleNamespace(logits=self.head(self.emb(input_ids)))

    torch.manual_seed(0)
    return Bigram()


@pytest.mark.parametrize(
    ("hits", "k", "counts"),
    [
        # a run of 2, the target's token, then a run of 4 (the last step drafts past the end)
        ([1, 1, 0, 1, 1, 1, 1, 1], 4, (6, 8)),
        ([0, 0, 0], 4, (0, 12)),  # nothing accepted: the target gives one token a step
        ([1] * 8, 3, (6, 6)),  # 3 accepted and the target's token, twice: 8 tokens in 2 steps
        ([], 4, (0, 0)),
    ],
)
def test_greedy_acceptance_counts_steps_as_speculation_does(hits, k, counts):
    from batchspec.distill.train import _steps

    assert _steps([bool(h) for h in hits], k) == counts


@pytest.mark.vllm
def test_greedy_acceptance_of_a_perfect_and_a_useless_draft():
    from batchspec.distill.train import first_windows, greedy_acceptance, train_draft

    rows = _rows(16, 1)
    model = _bigram()
    train_draft(model, rows, steps=60, lr=0.05, batch_size=8, seed=0, pad_id=0, window=4)
    held = first_windows(_rows(8, 1, seed=1), 4)
    assert all(len(ex.tokens) == 2 + 4 for ex in held)  # the prompt and the job's 4 tokens
    # learned x -> x + 1: every proposal accepted; k=4 over 4 tokens is one step of 4
    assert greedy_acceptance(model, held, 4) == 1.0
    assert greedy_acceptance(_bigram(), held, 4) < 0.2


@pytest.mark.vllm
def test_held_out_agreement_rises_on_what_generalises():
    from batchspec.distill.train import train_draft

    model = _bigram()
    said: list[str] = []
    result = train_draft(
        model, _rows(64, 1), steps=60, lr=0.05, batch_size=8, seed=0, pad_id=0, progress=said.append,
        window=4, validation=_rows(8, 1, seed=1), eval_every=10,
    )  # fmt: skip
    assert result.validation_agreement > result.start_validation_agreement + 0.5
    assert result.best_step > 0 and result.history[0][0] == 0
    assert any("validation acceptance at k=4 at step 10" in m for m in said)


@pytest.mark.vllm
def test_training_stops_when_held_out_agreement_stops_rising_and_keeps_the_best_weights():
    import torch

    from batchspec.distill.train import train_draft

    model = _bigram()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    said: list[str] = []
    # trained on +1, validated on +2: what it learns never holds on the validation rows
    result = train_draft(
        model, _rows(64, 1), steps=200, lr=0.05, batch_size=8, seed=0, pad_id=0, progress=said.append,
        window=4, validation=_rows(8, 2, seed=1), patience=2, eval_every=10,
    )  # fmt: skip
    assert result.stopped_early and result.steps < 200
    assert result.best_step == 0 and len(result.history) == 3  # start, then two without a new best
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # the start kept
    assert any("stopped at step" in m for m in said)


@pytest.mark.vllm
def test_without_validation_rows_training_runs_every_step():
    from batchspec.distill.train import train_draft

    result = train_draft(_bigram(), _rows(16, 1), steps=5, lr=0.05, batch_size=4, seed=0, pad_id=0)
    assert result.steps == 5 and result.best_step is None and not result.stopped_early


# --------------------------------------------------------------------------- the noise and the decision


def _counts(rates: list[float], drafted: int = 100) -> dict[str, tuple[int, int]]:
    return {f"p{i}": (round(r * drafted), drafted) for i, r in enumerate(rates)}


def test_paired_gain_is_the_ratio_difference_with_its_delta_method_error():
    before = {"a": (10, 40), "b": (30, 60)}
    after = {"a": (20, 40), "b": (30, 60), "c": (5, 5)}  # c: not on both sides, left out
    gain, se, n = paired_gain(before, after)
    assert n == 2 and gain == pytest.approx(50 / 100 - 40 / 100)
    z = [(20 - 0.5 * 40) / 100 - (10 - 0.4 * 40) / 100, (30 - 0.5 * 60) / 100 - (30 - 0.4 * 60) / 100]
    assert se == pytest.approx(math.sqrt(2 / 1 * sum(v * v for v in z)))
    assert paired_gain({"a": (1, 2)}, {"a": (2, 2)})[1] == math.inf  # one pair: no spread


def test_a_gain_within_the_noise_is_not_installed():
    # the case: 0.3937 -> 0.3932, prompts spread around it
    before = _counts([0.2, 0.6, 0.4, 0.35, 0.45] * 24)
    after = _counts([0.25, 0.55, 0.4, 0.3, 0.5] * 24)
    decision = decide(before, after, force=False)
    assert not decision.install and not decision.forced
    assert abs(decision.gain) < decision.margin and decision.prompts == 120
    assert "not more than the noise margin" in decision.reason


def test_a_clear_gain_is_installed():
    decision = decide(_counts([0.4, 0.5, 0.3] * 40), _counts([0.6, 0.7, 0.55] * 40), force=False)
    assert decision.install and not decision.forced
    assert decision.gain == pytest.approx(0.2167, abs=1e-3) and MIN_MARGIN <= decision.margin < decision.gain


def test_the_margin_is_two_standard_errors_and_never_below_the_floor():
    before = _counts([0.4] * 50)
    assert decide(before, _counts([0.404] * 50), force=False).margin == MIN_MARGIN  # no spread: the floor
    assert not decide(before, _counts([0.404] * 50), force=False).install
    noisy_before, noisy_after = _counts([0.2, 0.8] * 10), _counts([0.3, 0.8] * 10)
    gain, se, _ = paired_gain(noisy_before, noisy_after)
    assert decide(noisy_before, noisy_after, force=False).margin == pytest.approx(NOISE_SE * se, abs=1e-4)


def test_force_installs_and_says_it_was_forced():
    before, after = _counts([0.5] * 10), _counts([0.45] * 10)
    decision = decide(before, after, force=True)
    assert decision.install and decision.forced and decision.gain < 0


def test_without_a_starting_drafter_there_is_nothing_to_beat():
    assert decide(None, _counts([0.3] * 4), force=False, baseline=False).install
    assert decide(None, None, force=False, baseline=False).install
    assert not decide(None, None, force=False).install  # a drafter to beat, nothing measured
    assert decide(None, None, force=True).forced
    too_few = decide({"a": (1, 4)}, {"a": (4, 4)}, force=False)
    assert not too_few.install and too_few.margin is None and "too few" in too_few.reason


def test_not_installed_has_its_own_exit_code():
    exc = NotInstalled("no", result=None)
    assert exc.exit_code == 4 and exc.kind == "not installed"
