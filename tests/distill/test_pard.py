"""Parallel drafting: parallel drafts (``batchspec distill --method pard``;
batchspec/distill/pard.py) and parallel EAGLE-3 heads (``--method peagle``; P-EAGLE,
batchspec/distill/eagle3.py). Without an engine: the training batch's layout, the one-pass
forward and the validation figures stepped as vLLM steps; the mask token chosen or refused before
any work; the specs vLLM would refuse (a drafter naming no mask token, a head without
``mask_hidden``, DFlash) refused at validate; a parallel head's baseline from a sequential head.
On the real engine: a parallel draft distilled from the tiny draft and gated against it drafting
in parallel, and a new parallel head; each installed with its mask token, run by `batchspec run`
(killed after its first commit and run again: every row once) with greedy text equal to
speculation off, its acceptance in the columns and in `batchspec report`, and weighed by `tune`
both in parallel and a token a pass.

Engine time: about 8 minutes (for each kind: distill's generation and two evaluations, three
runs, and a tune at k=3)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from domain_data import write_shards
from helpers.jobs import DRAFT, ENGINE, MODELS, read_output, run_cli, run_cli_in_process, write_job
from helpers.recovery import Job

from batchspec.distill.options import DistillOptions
from batchspec.distill.pard import ParallelObjective, choose_mask_token, parallel_acceptance
from batchspec.distill.session import check_options
from batchspec.distill.train import Example, _steps
from batchspec.errors import SpecError
from batchspec.spec.load import load_spec
from batchspec.spec.methods import detect, vllm_speculative

K = 3
MASK = 0
#: Shards of the runs compared with speculation off (one is committed before the kill).
SHARDS = 6


def _example(tokens: list[int], prompt_len: int) -> Example:
    import torch

    return Example(torch.tensor(tokens, dtype=torch.long), prompt_len)


@pytest.mark.vllm  # torch
def test_the_batch_packs_k_minus_1_masks_for_each_drawn_point_and_labels_the_tokens_after_it():
    import torch

    from batchspec.distill.pard import POINTS

    ex = _example([5, 6, 7, 10, 11, 12, 13, 14], prompt_len=3)  # prompt 5 6 7, window 10..14
    tokens, n, m = ex.tokens.tolist(), 8, K - 1
    objective = ParallelObjective(k=K, mask=MASK)
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids, inputs, labels, teacher, weight = objective.batch([ex], [0], pad_id=1, topk=False, gen=gen)
        row, lab, w = ids[0].tolist(), labels[0].tolist(), weight[0]
        allowed, positions = inputs["attention_mask"][0, 0], inputs["position_ids"][0].tolist()
        assert teacher is None and len(row) == n + POINTS * m
        # the window whole, causal, its next token labelled at every position from the prompt's last on
        assert row[:n] == tokens and positions[:n] == list(range(n))
        assert torch.equal(allowed[:n, :n], torch.ones(n, n, dtype=torch.bool).tril())
        assert not allowed[:n, n:].any()  # no real position sees a mask
        assert lab[:n] == [-100] * 2 + tokens[3:] + [-100]
        for g in range(POINTS):
            at = range(n + g * m, n + (g + 1) * m)
            point = positions[at[0]]  # the first mask sits where token `point` would
            seen.add(point)
            assert 3 <= point <= 7 and [row[i] for i in at] == [MASK] * m
            assert [positions[i] for i in at] == list(range(point, point + m))
            for j, i in enumerate(at):
                # the real tokens before the point and the group's earlier masks, nothing else
                assert allowed[i].nonzero().flatten().tolist() == [*range(point), *at[: j + 1]]
                assert lab[i] == (tokens[point + j + 1] if point + j + 1 < n else -100)
        # half the loss on the next tokens, half on the masks' (where any is labelled)
        masked = any(lab[i] != -100 for i in range(n, len(row)))
        assert abs(float(w[:n].sum()) - (0.5 if masked else 1.0)) < 1e-6
        assert abs(float(w.sum()) - 1.0) < 1e-6
    assert seen == {3, 4, 5, 6, 7}  # every point of the window is drawn


@pytest.mark.vllm  # torch
def test_a_packed_batch_gives_each_mask_what_a_pass_truncated_at_its_point_gives(models):
    """The packing changes nothing the draft computes: each mask's logits equal those of the
    mask in a pass over the window cut at its point, as vLLM runs it."""
    import torch
    from transformers import LlamaForCausalLM

    from batchspec.distill.train import _logits

    draft = LlamaForCausalLM.from_pretrained(models / "draft", dtype=torch.float32).eval()
    tokens = torch.randint(3, 2000, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    objective = ParallelObjective(k=K, mask=MASK)
    ids, inputs, labels, _, _ = objective.batch(
        [_example(tokens, prompt_len=6)], [0], pad_id=1, topk=False, gen=torch.Generator().manual_seed(4)
    )
    everywhere = torch.ones_like(labels, dtype=torch.bool)
    with torch.no_grad():
        packed = _logits(draft, ids, inputs, everywhere).view(ids.shape[1], -1)
        alone = _logits(draft, torch.tensor([tokens]), None, torch.ones(1, 20, dtype=torch.bool))
        assert torch.allclose(packed[:20], alone, atol=1e-4)  # the real positions
        positions = inputs["position_ids"][0].tolist()
        for i in range(20, ids.shape[1]):
            first = 20 + (i - 20) // (K - 1) * (K - 1)
            point, j = positions[first], i - first
            cut = torch.tensor([tokens[:point] + [MASK] * (K - 1)])
            truncated = _logits(draft, cut, None, torch.ones_like(cut, dtype=torch.bool))
            assert torch.allclose(packed[i], truncated[point + j], atol=1e-4), (i, point, j)


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


def _job(
    tmp: Path, speculative: dict | None = SEQUENTIAL, rows: int = 48, shards: int = 2, **execution
) -> Path:
    """A job over ``shards`` shards of prompts like the tiny models' (None: speculation off),
    with ``execution`` keys."""
    write_shards(tmp / "prompts", rows=rows, shards=shards, seed=5)
    return write_job(
        tmp / "job.yaml",
        input={"path": str(tmp / "prompts" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp / "out")},
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        **({"speculative": speculative} if speculative is not None else {}),
        **({"execution": execution} if execution else {}),
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
    # one naming a token outside its vocabulary: vLLM would fail on its first parallel step
    import shutil

    draft = Path(shutil.copytree(models / "draft", tmp_path / "outside"))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "pard_token": config["vocab_size"]}))
    job = _job(tmp_path / "b", {"method": "pard", "model": str(draft), "num_speculative_tokens": K})
    done = run_cli_in_process("validate", str(job))
    assert done.returncode == 2, done.stderr
    assert "speculative.model" in done.stderr and "not a token id" in done.stderr


def _distilled(tmp_path_factory, name: str, *options: str):
    """``batchspec distill`` of a job's own prompts into ``name`` with ``options``: (the work
    folder, the job, the output, the finished process)."""
    tmp = tmp_path_factory.mktemp(name)
    job = _job(tmp)
    out = tmp / name
    done = run_cli(
        "distill", str(job), *options, "--out", str(out),
        "--sample", "48", "--holdout", "12", "--steps", "60", "--batch-size", "8", "--json",
    )  # fmt: skip
    return tmp, job, out, done


def _greedy_equals_off(tmp: Path, drafter: Path, method: str) -> None:
    """`batchspec run` with ``drafter`` (named by its checkpoint alone: its config says
    ``method``), killed (SIGKILL) after its first commit and run again, gives every row once and
    speculation off's greedy text, with its acceptance in the columns, its method in each output
    file's metadata, and `batchspec report`'s acceptance figures the columns' own."""
    speculative = {"model": str(drafter), "num_speculative_tokens": K}
    # one row in flight, so that the shards commit one after another, seconds apart, and the
    # kill lands between them (with every row in flight, all six commit within milliseconds)
    jobs = {
        name: _job(tmp / name, spec, rows=24, shards=SHARDS, max_in_flight=1)
        for name, spec in ((method, speculative), ("off", None))
    }
    killed = Job(jobs[method])
    first = killed.wait_for("shard_committed")
    assert first is not None, killed.stderr[-3000:]
    killed.kill_group()
    killed.wait()
    committed = len(list((tmp / method / "out").glob("*.parquet")))
    assert committed < SHARDS, f"{method}: every shard committed before the kill"
    runs = {}
    for name, job in jobs.items():
        ran = run_cli("run", str(job), "--log-format", "json")
        assert ran.returncode == 0, ran.stderr[-3000:]
        runs[name] = read_output(tmp / name / "out").sort_by("id")
        if name == method:
            events = [json.loads(line) for line in ran.stderr.splitlines() if line.startswith("{")]
            assert first["shard"] in [e["shard"] for e in events if e["event"] == "shard_skipped"]
    ids = runs[method].column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 24 and ids == runs["off"].column("id").to_pylist()
    assert (
        runs[method].column("generated_text").to_pylist() == runs["off"].column("generated_text").to_pylist()
    )
    drafted = runs[method].column("spec_num_draft_tokens")
    accepted = runs[method].column("spec_num_accepted_tokens")
    assert pc.min(drafted).as_py() > 0 and pc.sum(accepted).as_py() > 0
    for part in (tmp / method / "out").glob("*.parquet"):
        meta = json.loads(pq.read_schema(part).metadata[b"batchspec"])
        assert meta["speculative_method"] == method, meta
    report = run_cli_in_process("report", str(tmp / method / "out"), "--format", "json")
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)
    assert shown["lineage"]["speculative_method"] == [method], shown["lineage"]
    assert len(shown["lineage"]["run_id"]) == 2  # the killed run's shard and the rerun's
    overall = shown["overall"]
    steps = pc.sum(runs[method].column("spec_num_steps")).as_py()
    assert overall["speculative"] and overall["mean_acceptance_length"] == pytest.approx(
        1 + pc.sum(accepted).as_py() / steps
    )


@pytest.fixture(scope="module")
def parallel(tmp_path_factory, models):
    """A parallel draft distilled from the tiny draft on a job's own prompts (the gate on)."""
    return _distilled(
        tmp_path_factory, "parallel-draft", "--method", "pard", "--draft", str(models / "draft")
    )


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
    _greedy_equals_off(tmp, out, "pard")


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


# ---------------------------------------------------------------------------- P-EAGLE


def _head(models: Path, mask: int | None = MASK):
    """The tiny target's head (``make models``), made parallel when ``mask`` is given."""
    from batchspec.distill import eagle3

    head = eagle3.load_head(str(models / "head"), str(models / "target"))
    if mask is not None:
        head.make_parallel(mask)
    return head


@pytest.mark.vllm  # torch
def test_a_parallel_heads_pass_drafts_its_real_positions_as_step_0_and_each_mask_group_sees_its_prefix(
    models,
):
    import torch

    from batchspec.distill.peagle import parallel_pass

    head = _head(models)
    with torch.no_grad():
        head.mask_hidden.normal_()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 2000, (2, 20), generator=gen)
    aux = torch.randn(2, 20, head.fed, generator=gen)
    points = torch.tensor([[3, 10], [0, 17]])
    with torch.no_grad():
        real, masks = parallel_pass(head, tokens, aux, points, K)
        step0 = head.unroll(tokens, aux, 1)[0]
        assert real.shape == step0.shape and masks.shape == (2, 2, K - 1, real.shape[-1])
        # the mask positions change nothing the real positions compute (no real position sees them)
        assert torch.allclose(real, step0, atol=1e-5)
        # a group sees the positions up to its point and nothing after (position t reads token t + 1)
        later_tokens, later_aux = tokens.clone(), aux.clone()
        later_tokens[0, 5:], later_aux[0, 4:] = 7, 0.0
        _, changed = parallel_pass(head, later_tokens, later_aux, points, K)
    assert torch.allclose(changed[0, 0], masks[0, 0], atol=1e-5)
    assert not torch.allclose(changed[0, 1], masks[0, 1])
    assert torch.allclose(changed[1], masks[1], atol=1e-5)


@pytest.mark.vllm  # torch
def test_a_parallel_heads_loss_trains_mask_hidden_and_its_figure_counts_a_run_of_k(models):
    import torch

    from batchspec.distill.peagle import draft_points, parallel_losses, parallel_pass

    head = _head(models)
    tokens = torch.randint(3, 2000, (2, 12))
    batch = {
        "tokens": tokens,
        "aux": torch.randn(2, 12, head.fed),
        "labels": torch.randint(3, 2000, (2, 12)),
        "lengths": torch.tensor([12, 6]),
        "prompts": torch.tensor([0, 0]),
    }
    loss, _, counted = parallel_losses(head, batch, K, gen=torch.Generator().manual_seed(1))
    loss.backward()
    assert counted == 2 * 4 and float(head.mask_hidden.grad.abs().sum()) > 0
    # points are drawn where vLLM drafts: from the prompt's last position to the last that reads a token
    drawn = draft_points({**batch, "prompts": torch.tensor([7, 9])}, torch.rand(2, 400))
    assert set(drawn[0].tolist()) == set(range(6, 11)) and set(drawn[1].tolist()) == {4}
    # the figure: right in a row from each point, the real position's token first, then the masks'
    with torch.no_grad():
        points = torch.tensor([[2], [1]])
        real, masks = parallel_pass(head, tokens, batch["aux"], points, K)
        labels = batch["labels"].clone()
        labels[0, 3] = real[0, 2].argmax()  # point 2: its real position is right,
        labels[0, 4] = masks[0, 0, 0].argmax()  # its first mask too,
        labels[0, 5] = (masks[0, 0, 1].argmax() + 1) % 2000  # its second not: 2 in a row
        labels[1, 2] = (real[1, 1].argmax() + 1) % 2000  # point 1 of row 1: wrong at once
        _, right, counted = parallel_losses(head, {**batch, "labels": labels}, K, points)
    assert (right, counted) == (2, 2)


@pytest.mark.vllm  # torch
def test_a_parallel_head_is_written_as_vllm_loads_it_and_read_back(models, tmp_path):
    import torch
    from safetensors.torch import load_file

    from batchspec.distill import eagle3

    head = _head(models, mask=5)
    with torch.no_grad():
        head.mask_hidden.fill_(0.25)
    eagle3.save_head(head, tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["mask_token_id"] == 5 and config["transformer_layer_config"]["mask_token_id"] == 5
    assert detect(config) == "peagle"
    assert load_file(str(tmp_path / "p" / "model.safetensors"))["mask_hidden"].shape == (1, head.fed)
    back = eagle3.load_head(str(tmp_path / "p"), str(models / "target"))
    assert torch.equal(back.mask_hidden, head.mask_hidden.detach())
    # the sequential head written by make models has no mask: none read
    assert _head(models, mask=None).mask_hidden is None


def test_peagle_is_eagle3_drafting_in_parallel_and_dflash_is_refused(tmp_path, models):
    from batchspec.spec.build import build_spec

    layer = {"model_type": "llama", "hidden_size": 256}
    head = {"speculators_model_type": "eagle3", "transformer_layer_config": layer}
    assert detect(head) == "eagle3"
    assert detect({**head, "transformer_layer_config": {**layer, "mask_token_id": 0}}) == "peagle"
    assert detect({**head, "mask_token_id": 3}) == "peagle"
    assert detect({"speculators_model_type": "peagle"}) == "peagle"
    section = {"method": "peagle", "model": "h", "num_speculative_tokens": 3}
    assert vllm_speculative(section) == {**section, "method": "eagle3", "parallel_drafting": True}
    spec = load_spec(_job(tmp_path, None))
    raw = {**spec.raw, "speculative": {"method": "eagle3", "parallel_drafting": True, "model": "h"}}
    assert build_spec(raw).speculative == {"method": "peagle", "model": "h"}
    raw["speculative"] = {"method": "dflash", "model": str(models / "draft"), "num_speculative_tokens": 3}
    with pytest.raises(SpecError, match="DFlash") as err:
        build_spec(raw)
    assert err.value.key == "speculative.method"


def _head_job(tmp: Path, head: Path) -> Path:
    return _job(
        tmp, {"method": "eagle3", "parallel_drafting": True, "model": str(head), "num_speculative_tokens": K}
    )


def test_a_parallel_head_vllm_could_not_run_exits_2_at_validate(tmp_path, models):
    import shutil

    # a head naming no mask token (make models' sequential head), in vLLM's own spelling
    done = run_cli_in_process("validate", str(_head_job(tmp_path / "a", models / "head")))
    assert done.returncode == 2, done.stderr
    assert "speculative.model" in done.stderr and "mask token" in done.stderr and "peagle" in done.stderr
    # a head naming one but holding no mask_hidden: vLLM would refuse it when its weights load
    head = Path(shutil.copytree(models / "head", tmp_path / "named"))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "mask_token_id": 0}))
    done = run_cli_in_process("validate", str(_head_job(tmp_path / "b", head)))
    assert done.returncode == 2, done.stderr
    assert "speculative.model" in done.stderr and "mask_hidden" in done.stderr
    # DFlash, by the command a user runs
    job = _job(
        tmp_path / "c", {"method": "dflash", "model": str(models / "draft"), "num_speculative_tokens": K}
    )
    done = run_cli_in_process("validate", str(job))
    assert done.returncode == 2 and "speculative.method" in done.stderr, done.stderr


def test_peagle_options_are_checked_before_any_work(tmp_path, models):
    spec = load_spec(_job(tmp_path))
    refused = (
        ({"draft": str(models / "draft")}, "--draft"),
        ({"head": str(models / "draft")}, "--head"),
        ({"mask_token": 5000}, "--mask-token"),
        ({"logprobs": 4}, "--logprobs"),
    )
    for given, key in refused:
        opts = DistillOptions(out=tmp_path / "d", method="peagle", **given)
        with pytest.raises(SpecError) as err:
            check_options(spec, opts)
        assert err.value.key == key, (given, err.value)
    # a sequential head to continue, and a mask token of the vocabulary, are taken
    check_options(
        spec, DistillOptions(out=tmp_path / "d", method="peagle", head=str(models / "head"), mask_token=3)
    )


def test_tune_weighs_a_parallel_head_in_parallel_and_a_token_a_pass(tmp_path, models):
    from batchspec.distill import eagle3
    from batchspec.tune.search_space import candidates

    eagle3.save_head(_head(models), tmp_path / "fast-head")
    spec = load_spec(_job(tmp_path, None))
    _, families = candidates(spec, [str(tmp_path / "fast-head")], [3], ngram=False)
    methods = {name: [c.speculative["method"] for c in fam] for name, fam in families.items()}
    assert methods == {"peagle:fast-head": ["peagle"], "eagle3:fast-head": ["eagle3"]}


def test_a_parallel_head_from_a_head_is_judged_against_that_head_drafting_in_parallel(tmp_path, models):
    """--head drafting a token a pass: the baseline is a copy of it naming the mask token, with
    ``mask_hidden`` zeros (what the new head starts from), which vLLM runs in parallel."""
    from safetensors.torch import load_file

    from batchspec.distill.trainers import PEAGLE_TRAINER
    from batchspec.engine.heads import check_speculative_model

    spec = load_spec(_job(tmp_path))
    opts = DistillOptions(out=tmp_path / "d", method="peagle", head=str(models / "head"), mask_token=7)
    said: list[str] = []
    copy = Path(PEAGLE_TRAINER.baseline(spec, opts, tmp_path / "work", said.append))
    assert said == ["the starting head, judged drafting in parallel: mask token 7"]
    assert detect(json.loads((copy / "config.json").read_text())) == "peagle"
    weights = load_file(str(copy / "model.safetensors"))
    assert not weights["mask_hidden"].any()
    assert weights["fc.weight"].equal(load_file(str(models / "head" / "model.safetensors"))["fc.weight"])
    check_speculative_model(str(models / "target"), {"method": "peagle", "model": str(copy)})
    # a head that is parallel already is its own baseline
    opts = DistillOptions(out=tmp_path / "d", method="peagle", head=str(copy))
    assert PEAGLE_TRAINER.baseline(spec, opts, tmp_path / "work", said.append) == str(copy)


@pytest.fixture(scope="module")
def parallel_head(tmp_path_factory, models):
    """A new parallel head distilled on a job's own prompts (no head to beat: installed)."""
    return _distilled(tmp_path_factory, "parallel-head", "--method", "peagle")


@pytest.mark.engine
def test_distill_trains_and_installs_a_parallel_head_that_runs_with_greedy_text_equal_to_off(
    parallel_head, models
):
    from safetensors import safe_open

    tmp, job, out, done = parallel_head
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["decision"]["install"] and not result["decision"]["forced"], result["decision"]
    # vLLM drafted with it in parallel on the held-out prompts, and its masks proposed tokens it kept
    after = result["after"]
    assert after["num_speculative_tokens"] == K and after["acceptance_per_position"][1] > 0, after
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["mask_token_id"] == 0
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert float(weights.get_tensor("mask_hidden").abs().sum()) > 0  # trained, not the zeros
    card = json.loads((out / "batchspec-model.json").read_text())
    assert card["method"] == "peagle" and card["role"] == "head"

    _greedy_equals_off(tmp, out, "peagle")


@pytest.mark.engine
@pytest.mark.parametrize(
    ("drafter", "in_parallel", "sequential"),
    [("parallel", "pard:{}", "{}"), ("parallel_head", "peagle:{}", "eagle3:{}")],
)
def test_tune_measures_a_parallel_drafter_beside_its_weights_drafting_a_token_a_pass(
    request, drafter, in_parallel, sequential
):
    tmp, job, out, done = request.getfixturevalue(drafter)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = run_cli(
        "tune", str(job), "--sample", "8", "--concurrency", "1", "--k", str(K), "--no-ngram",
        "--no-batch-knobs", "--draft", str(out), "--json",
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    entries = {c["label"]: c for c in json.loads(tuned.stdout)["candidates"]}
    labels = [f"{in_parallel.format(out.name)} k={K}", f"{sequential.format(out.name)} k={K}"]
    assert {"off", *labels} <= set(entries), sorted(entries)
    assert entries[labels[0]]["speculative"]["method"] == in_parallel.split(":")[0]
    for label in labels:
        entry = entries[label]
        assert not entry["skipped"] and entry["output_tokens_per_s"] > 0, entry
        assert entry["mean_acceptance_length"] > 1, entry


@pytest.mark.parametrize("kind", ["pard", "peagle"])
def test_auto_writes_a_parallel_drafter_where_tune_recommends_it(tmp_path, models, kind):
    """`speculative: auto` runs the section of what tune's measurements recommend: a parallel
    drafter is one of its candidates, both ways, and chosen as any other."""
    import shutil

    from batchspec.distill import eagle3
    from batchspec.tune.auto import _section

    if kind == "pard":
        drafter = Path(shutil.copytree(models / "draft", tmp_path / "fast"))
        config = json.loads((drafter / "config.json").read_text())
        (drafter / "config.json").write_text(json.dumps({**config, "pard_token": 0}))
        sequential = "fast k=3"
    else:
        drafter = tmp_path / "fast"
        eagle3.save_head(_head(models), drafter)
        sequential = "eagle3:fast k=3"
    auto = {"method": "auto", "drafts": [str(drafter)], "k": [K]}
    spec = load_spec(_job(tmp_path, auto))
    section, label, level = _section(spec, {1: f"{kind}:fast k=3", 16: f"{kind}:fast k=3"})
    assert (label, level) == (f"{kind}:fast k=3", 16)
    assert section == {"method": kind, "model": str(drafter), "num_speculative_tokens": K}
    section, label, _ = _section(spec, {1: sequential, 16: sequential})
    assert label == sequential and section["method"] == ("draft_model" if kind == "pard" else "eagle3")
