"""The model tiers `make models` builds beside the tiny pair: the grown target
(tools/grow_model.py) and the larger draft (tools/tiny_models.py).

Growth is checked three ways: its arithmetic on random Llamas (no models needed; a large RMSNorm
eps makes a wrong eps or weight scaling visible), the built `.models/target-large` against the
tiny target with transformers, and once on the real engine, where the grown target with
`draft-large` speculating must give the tiny target's greedy tokens. The probe calls ``vllm.LLM``
directly, on the session's shared engines (tests/helpers/shared_engines.py): the tiny target's is the one
other tests' jobs without speculation use; the grown pair's is shut down after its one use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import grow_model  # noqa: E402
import tiny_models  # noqa: E402

#: torch and transformers, which the engine extra installs
pytestmark = pytest.mark.vllm

#: Held-out prompts and tokens for the checks on the built models.
CHECK_PROMPTS = 8
CHECK_TOKENS = 32


def random_llama(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 2,
    intermediate: int = 128,
    eps: float = 0.5,
    seed: int = 0,
):
    """A small random Llama whose norms have random weights and a large eps, so that growth
    arithmetic that is off in either shows in the logits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=eps,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )  # logits of order 1
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand_like(param) + 0.5)
    return model


def grown_copy(model, hidden: int, intermediate: int, layers: int):
    """``model`` grown with tools/grow_model.py's arithmetic, as a transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new_state, new_config = grow_model.grow_state_dict(
        state, model.config.to_dict(), hidden, intermediate, layers
    )
    grown = LlamaForCausalLM(LlamaConfig(**new_config)).eval()
    missing, unexpected = grown.load_state_dict(new_state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return grown


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_growth_keeps_the_function_of_a_random_llama(heads, kv_heads):
    import torch

    small = random_llama(heads=heads, kv_heads=kv_heads)
    big = grown_copy(small, hidden=256, intermediate=512, layers=5)
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = small(input_ids=ids).logits, big(input_ids=ids).logits
    assert want.std() > 0.5  # a model that says something, so agreement means something
    assert (want - got).abs().max().item() < 1e-4
    assert torch.equal(
        small.generate(ids[:, :8], max_new_tokens=16, do_sample=False),
        big.generate(ids[:, :8], max_new_tokens=16, do_sample=False),
    )
    # the cost is real: 4x the heads, 3 more layers, whose projections are not all zero
    assert big.config.num_attention_heads == 4 * heads and big.config.num_key_value_heads == 4 * kv_heads
    new_layer = big.model.layers[4]
    assert new_layer.self_attn.q_proj.weight.abs().sum() > 0
    assert new_layer.mlp.up_proj.weight.abs().sum() > 0
    assert sum(p.numel() for p in big.parameters()) > 10 * sum(p.numel() for p in small.parameters())


def test_grown_weights_are_deterministic():
    small = random_llama()
    state = dict(small.state_dict())
    first, _ = grow_model.grow_state_dict(state, small.config.to_dict(), 128, 256, 4)
    second, _ = grow_model.grow_state_dict(state, small.config.to_dict(), 128, 256, 4)
    assert first.keys() == second.keys()
    assert all(first[k].equal(second[k]) for k in first)


@pytest.mark.parametrize(
    "hidden,intermediate,layers,message",
    [
        (100, 256, 4, "not a multiple of head_dim 32"),
        (32, 256, 4, "must be at least"),
        (128, 256, 1, "must be at least"),
    ],
)
def test_growth_refuses_settings_it_cannot_honour(hidden, intermediate, layers, message):
    small = random_llama()
    with pytest.raises(ValueError, match=message):
        grow_model.grow_state_dict(
            dict(small.state_dict()), small.config.to_dict(), hidden, intermediate, layers
        )


def save_source(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    (path / grow_model.COMPLETE_MARKER).write_text("ok\n")
    return path


def test_grow_skips_a_current_model_and_regrows_a_stale_one(tmp_path, monkeypatch):
    # the logit check needs a tokenizer these random models lack; it is tested on the built models
    monkeypatch.setattr(grow_model, "max_logit_difference", lambda source, grown: 0.0)
    source = save_source(random_llama(), tmp_path / "src")
    out = tmp_path / "big"
    info = grow_model.grow(source, out, hidden=128, intermediate=256, layers=3)
    assert (out / grow_model.COMPLETE_MARKER).exists()
    assert info["parameters"] == json.loads((out / "batchspec-model.json").read_text())["parameters"]
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["rms_norm_eps"]) == (128, 3, 0.25)
    written = (out / "model.safetensors").stat().st_mtime_ns

    grow_model.grow(source, out, hidden=128, intermediate=256, layers=3)
    assert (out / "model.safetensors").stat().st_mtime_ns == written, "a current model was regrown"

    grow_model.grow(source, out, hidden=128, intermediate=256, layers=4)  # other settings
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    save_source(random_llama(seed=5), source)  # the source changed
    grow_model.grow(source, out, hidden=128, intermediate=256, layers=4)
    info = json.loads((out / "batchspec-model.json").read_text())
    assert info["source_sha256"] == grow_model.file_sha256(source / "model.safetensors")


def test_grow_that_changes_the_function_fails_and_keeps_the_old_model(tmp_path, monkeypatch):
    monkeypatch.setattr(grow_model, "max_logit_difference", lambda source, grown: 0.0)
    source = save_source(random_llama(), tmp_path / "src")
    out = tmp_path / "big"
    grow_model.grow(source, out, hidden=128, intermediate=256, layers=3)
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(grow_model, "max_logit_difference", lambda source, grown: 0.5)
    with pytest.raises(ValueError, match=r"differs from it by 5\.00e-01"):
        grow_model.grow(source, out, hidden=128, intermediate=256, layers=4)
    assert (out / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "big.tmp").exists()


def test_grow_needs_a_built_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="src is not built"):
        grow_model.grow(tmp_path / "src", tmp_path / "big")


def test_a_draft_starts_from_as_many_target_layers_as_it_has():
    import torch

    target, draft = random_llama(layers=4, seed=1), random_llama(layers=2, seed=2)
    tiny_models.init_draft_from_target(draft, target)
    for i in range(2):
        for key, value in draft.model.layers[i].state_dict().items():
            assert torch.equal(value, target.model.layers[i].state_dict()[key]), f"layer {i} {key}"
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)


# ------------------------------------------------------------------ the built models (make models)


@pytest.fixture(scope="module")
def tiers(models: Path) -> Path:
    """The tiny pair plus `target-large` and `draft-large`, as `make models` builds them."""
    for name in ("target-large", "draft-large"):
        if not (models / name / ".batchspec-complete").exists():
            pytest.fail(f"{models / name} is not built: run `make models` first")
    return models


@pytest.fixture(scope="module")
def held_out_prompts() -> list[str]:
    return tiny_models.held_out_snippets(CHECK_PROMPTS, seed=2024)


def test_target_large_is_the_tiny_target_at_a_large_models_cost(tiers, held_out_prompts):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiers / "target-large")
    tiny = LlamaForCausalLM.from_pretrained(tiers / "target", dtype=torch.float32).eval()
    large = LlamaForCausalLM.from_pretrained(tiers / "target-large", dtype=torch.float32).eval()
    assert sum(p.numel() for p in large.parameters()) > 200e6
    info = json.loads((tiers / "target-large" / "batchspec-model.json").read_text())
    assert info["max_logit_difference"] < 1e-4
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tiers / "target-large" / name).read_bytes() == (tiers / "target" / name).read_bytes()
    with torch.no_grad():
        for prompt in held_out_prompts[:4]:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            diff = (tiny(input_ids=ids).logits - large(input_ids=ids).logits).abs().max().item()
            assert diff < 1e-4, f"logits differ by {diff:.2e} on {prompt!r}"
        # greedy text on one prompt here (a 205M model decodes slowly in eager transformers);
        # the engine test below compares all CHECK_PROMPTS prompts' greedy tokens
        ids = tokenizer(held_out_prompts[0], return_tensors="pt")["input_ids"]
        want = tiny.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
        got = large.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
        assert got.tolist() == want.tolist(), f"greedy text differs on {held_out_prompts[0]!r}"


def agreement(draft, sequences: list) -> float:
    """Top-1 agreement of ``draft`` with the target on the target's own greedy continuations
    (teacher forced): the first-position acceptance of greedy speculation."""
    import torch

    agree = total = 0
    with torch.no_grad():
        for ids, prompt_len in sequences:
            predicted = draft(input_ids=ids).logits[0, prompt_len - 1 : -1].argmax(-1)
            agree += (predicted == ids[0, prompt_len:]).sum().item()
            total += ids.shape[1] - prompt_len
    return agree / total


def test_draft_large_agrees_with_the_target_more_than_the_draft(tiers):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiers / "target", padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    target = LlamaForCausalLM.from_pretrained(tiers / "target", dtype=torch.float32).eval()
    # the target's greedy continuations, generated as one left-padded batch, then unpadded
    batch = tokenizer(tiny_models.held_out_snippets(32, seed=99), return_tensors="pt", padding=True)
    with torch.no_grad():
        out = target.generate(
            **batch,
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    width = batch["input_ids"].shape[1]
    sequences = []
    for row, mask in zip(out, batch["attention_mask"], strict=True):
        pad = width - int(mask.sum())
        sequences.append((row[pad:].unsqueeze(0), width - pad))
    load = lambda name: LlamaForCausalLM.from_pretrained(tiers / name, dtype=torch.float32).eval()  # noqa: E731
    small, large = load("draft"), load("draft-large")
    assert (large.config.num_hidden_layers, small.config.num_hidden_layers) == (2, 1)
    assert large.config.vocab_size == target.config.vocab_size
    small_agreement, large_agreement = agreement(small, sequences), agreement(large, sequences)
    assert large_agreement > small_agreement + 0.01, (small_agreement, large_agreement)


# ------------------------------------------------------------------------------ the real engine


def probe(llm, prompts: list[str]) -> dict:
    """Generate greedily on one engine (a ``vllm.LLM``): token ids and draft totals."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS), use_tqdm=False)
    drafted = accepted = 0
    for out in outputs:
        metrics = getattr(out.outputs[0], "spec_decode_metrics", None)
        if metrics is not None:
            drafted += metrics.to_dict()["num_draft_tokens"]
            accepted += metrics.to_dict()["num_accepted_draft_tokens"]
    return {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "drafted": drafted,
        "accepted": accepted,
    }


@pytest.mark.engine
def test_vllm_target_large_with_draft_large_gives_the_tiny_targets_greedy_tokens(
    tiers, held_out_prompts, shared_engines
):
    from helpers.jobs import ENGINE

    tiny = probe(
        shared_engines.engine(shared_engines.probe_spec(tiers / "target", ENGINE)).llm, held_out_prompts
    )
    grown = shared_engines.probe_spec(
        tiers / "target-large",
        ENGINE,
        {"method": "draft_model", "model": str(tiers / "draft-large"), "num_speculative_tokens": 4},
    )
    try:
        large = probe(shared_engines.engine(grown).llm, held_out_prompts)
    finally:
        shared_engines.release(grown)  # no other test uses the grown pair
    assert all(len(ids) == CHECK_TOKENS for ids in tiny["token_ids"])
    for i, (want, got) in enumerate(zip(tiny["token_ids"], large["token_ids"], strict=True)):
        assert got == want, f"prompt {i}: {held_out_prompts[i]!r}"
    # draft-large really speculated, and well: the tokens above went through its proposals
    assert large["drafted"] > 0
    assert large["accepted"] / large["drafted"] > 0.4, large
