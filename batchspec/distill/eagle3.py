"""EAGLE-3 heads: built for a target, fed with its hidden states, trained with the training-time
test, and written in speculators' format, which vLLM loads as it is (``vllm serve`` too).

**The head** is vLLM's ``LlamaForCausalLMEagle3`` (``vllm/model_executor/models/llama_eagle3.py``)
written out in plain torch, so that training computes what vLLM will run: ``fc`` fuses the
target's hidden states at three layers (``eagle_aux_hidden_state_layer_ids``) into one of the
target's width; one decoder layer reads the next token's embedding (the target's own, frozen, not
stored in the head) beside that fused state, with rotary positions; ``norm`` and ``lm_head`` give
the proposal. Its later draft steps feed the layer's own pre-norm output back as the hidden state.

**The features** (the target's hidden states at the auxiliary layers and its greedy next
token) come from the target's own forward pass: :mod:`batchspec.distill.features`.

**Training** unrolls ``steps`` draft steps per position (EAGLE-3's training-time test): step 0
reads the target's fused state, step ``s`` reads step ``s - 1``'s output at the same position,
and attends to step 0's keys up to its position plus its own earlier steps' keys there (what
vLLM's KV cache holds when it drafts). The loss is cross-entropy against the target's greedy
token at each step, weighted ``0.8 ** s``. Held-out sequences measure the expected number of
tokens the head gets right in a row (:func:`expected_accepted`), which early stopping watches."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchspec.distill.peagle import EVAL_POINTS, draft_points, parallel_losses
from batchspec.spec.checkpoints import head_layer_config, text_config
from batchspec.spec.methods import MASK_HIDDEN, mask_token

#: The weight file a head is written to.
WEIGHTS = "model.safetensors"
#: Draft steps unrolled in training (the training-time test).
TTT_STEPS = 3
#: Weight of draft step s's loss: STEP_DECAY ** s.
STEP_DECAY = 0.8
#: Tokens of a sequence one training example holds: a random span of each sequence per batch
#: (rotary attention depends on distances only, so a span trains like the same tokens in place;
#: the cost of a step grows with its tokens).
SPAN = 64
#: The config keys copied from the target into the head's layer config.
_LAYER_KEYS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def default_aux_layers(layers: int) -> list[int]:
    """Three auxiliary layers spread over the target (low, middle, high), each a layer the
    target has: ``[1, L // 2, L - 1]`` (vLLM's default, ``(2, L // 2, L - 3)``, repeats or
    leaves the target on small ones)."""
    if layers < 3:
        return list(range(layers)) * 3 if layers else []
    return [1, layers // 2, layers - 1]


def head_config(
    target: dict,
    aux_layers: list[int] | None = None,
    k: int = 3,
    verifier: str = "",
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
) -> dict:
    """A head's ``config.json`` in speculators' format for a target's config."""
    layer = {key: target[key] for key in _LAYER_KEYS if key in target}
    layer["model_type"] = target.get("model_type", "llama")
    layer["architectures"] = ["LlamaForCausalLM"]
    layer["num_hidden_layers"] = 1
    layer["tie_word_embeddings"] = False
    hidden = target["hidden_size"]
    head_dim = target.get("head_dim") or hidden // target["num_attention_heads"]
    layer["head_dim"] = head_dim
    if num_attention_heads:
        layer["num_attention_heads"] = layer["num_key_value_heads"] = num_attention_heads
    if intermediate_size:
        layer["intermediate_size"] = intermediate_size
    ids = aux_layers if aux_layers is not None else default_aux_layers(target["num_hidden_layers"])
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": target["vocab_size"],
        "target_hidden_size": hidden,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": k,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target.get("architectures") or ())},
        },
        "torch_dtype": "float32",
    }


def _rope_theta(layer: dict) -> float:
    params = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    return float(params.get("rope_theta") or layer.get("rope_theta") or 10000.0)


def _module():
    import torch
    from torch import nn

    class Eagle3Head(nn.Module):
        """vLLM's Llama EAGLE-3 head in plain torch (see the module docstring)."""

        def __init__(self, config: dict, embed: torch.Tensor):
            super().__init__()
            self.config = config
            layer = head_layer_config(config)
            self.layer = layer
            hidden = layer["hidden_size"]
            self.heads = layer["num_attention_heads"]
            self.kv_heads = layer.get("num_key_value_heads") or self.heads
            self.head_dim = layer.get("head_dim") or hidden // self.heads
            inter = layer["intermediate_size"]
            vocab = config.get("draft_vocab_size") or layer["vocab_size"]
            fed = (config.get("target_hidden_size") or hidden) * len(
                config["eagle_aux_hidden_state_layer_ids"]
            )
            self.eps = float(layer.get("rms_norm_eps", 1e-6))
            self.norm_before_residual = bool(config.get("norm_before_residual", True))
            self.register_buffer("embed", embed.detach().float(), persistent=False)
            linear = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
            self.fc = linear(fed, hidden)
            self.hidden_norm = nn.Parameter(torch.ones(hidden))
            self.input_layernorm = nn.Parameter(torch.ones(hidden))
            self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
            self.norm = nn.Parameter(torch.ones(hidden))
            self.q_proj = linear(2 * hidden, self.heads * self.head_dim)
            self.k_proj = linear(2 * hidden, self.kv_heads * self.head_dim)
            self.v_proj = linear(2 * hidden, self.kv_heads * self.head_dim)
            self.o_proj = linear(self.heads * self.head_dim, hidden)
            self.gate_proj = linear(hidden, inter)
            self.up_proj = linear(hidden, inter)
            self.down_proj = linear(inter, hidden)
            self.lm_head = linear(hidden, vocab)
            inv = 1.0 / (_rope_theta(layer) ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)
            self.fed = fed
            self.mask_hidden = None
            if mask_token(config) is not None:
                self.make_parallel(mask_token(config))

        def make_parallel(self, mask: int) -> None:
            """Make this a parallel head (P-EAGLE) reading ``mask`` at its mask positions: the
            config names the token (where vLLM reads it), and ``mask_hidden``, the hidden state
            those positions read in place of the target's (zeros until trained), is added."""
            for where in (self.config, self.config.get("transformer_layer_config")):
                if isinstance(where, dict):
                    where["mask_token_id"] = int(mask)
            if self.mask_hidden is None:
                self.mask_hidden = nn.Parameter(torch.zeros(1, self.fed, device=self.fc.weight.device))

        # ---- the pieces of vLLM's forward
        def rms(self, x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

        def rope(self, x, positions):
            # x: (B, heads, T, d); positions: (T,) or (B, T) -- neox style, as vLLM's Llama
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if cos.dim() == 3:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return x * cos + rotated * sin

        def qkv(self, tokens, hidden, positions):
            """One step's queries, keys, values and residual at every position."""
            b, t = tokens.shape
            embeds = self.rms(self.embed[tokens], self.input_layernorm)
            if self.norm_before_residual:
                hidden = self.rms(hidden, self.hidden_norm)
                residual = hidden
            else:
                residual = hidden
                hidden = self.rms(hidden, self.hidden_norm)
            x = torch.cat([embeds, hidden], dim=-1)
            q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            return self.rope(q, positions), self.rope(k, positions), v, residual

        def finish(self, attn, residual):
            """(logits, the pre-norm output the next draft step reads)."""
            b, _, t, _ = attn.shape
            attn = self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
            residual = attn + residual
            x = self.rms(residual, self.post_attention_layernorm)
            x = self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
            residual = x + residual
            return self.lm_head(self.rms(residual, self.norm)), residual

        def unroll(self, tokens, aux, steps: int) -> list:
            """Logits of each draft step at each position ``t`` of ``tokens`` (B, L): step ``s``
            proposes token ``t + 2 + s`` (length L - 1 each, later positions past the end)."""
            b, length = tokens.shape
            t = length - 1
            scale = self.head_dim**-0.5
            pos = torch.arange(t, device=tokens.device)
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
            hidden = self.fc(aux[:, :-1].float())
            out, keys0, values0, extra_k, extra_v = [], None, None, [], []
            for s in range(steps):
                idx = (pos + 1 + s).clamp(max=length - 1)
                q, k, v, residual = self.qkv(tokens[:, idx], hidden, pos + s)
                if s == 0:
                    keys0, values0 = k, v
                else:
                    extra_k.append(k)
                    extra_v.append(v)
                main = (q @ keys0.transpose(-1, -2)) * scale
                main = main.masked_fill(~causal, float("-inf"))
                diag = [(q * ek).sum(-1, keepdim=True) * scale for ek in extra_k]
                weights = torch.softmax(torch.cat([main, *diag], dim=-1), dim=-1)
                attn = weights[..., :t] @ values0
                for j, ev in enumerate(extra_v):
                    attn = attn + weights[..., t + j : t + j + 1] * ev
                logits, hidden = self.finish(attn, residual)
                out.append(logits)
            return out

    return Eagle3Head


def new_head(target_dir: str, config: dict, seed: int = 0):
    """A head for the target, trained from nothing but its output layer: ``lm_head`` and
    ``norm`` start as the target's own (the proposal starts in the target's vocabulary space),
    the rest random (std 0.02), ``o_proj`` and ``down_proj`` small."""
    import torch

    weights = _target_weights(target_dir)
    torch.manual_seed(seed)
    head = _module()(config, weights["embed"])
    with torch.no_grad():
        for _name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
        if weights.get("lm_head") is not None and head.lm_head.weight.shape == weights["lm_head"].shape:
            head.lm_head.weight.copy_(weights["lm_head"])
        if weights.get("norm") is not None:
            head.norm.copy_(weights["norm"])
    return head


def _target_weights(target_dir: str) -> dict:
    """The target's token embedding, output head and final norm (read from its safetensors)."""
    from safetensors import safe_open

    found: dict[str, Any] = {}
    names = {
        "model.embed_tokens.weight": "embed",
        "lm_head.weight": "lm_head",
        "model.norm.weight": "norm",
    }
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name in names:
                    found[names[name]] = f.get_tensor(name).float()
    if "embed" not in found:
        raise ValueError(f"{target_dir}: no model.embed_tokens.weight in its safetensors files")
    if "lm_head" not in found:
        found["lm_head"] = found["embed"]  # tied embeddings
    return found


#: Head parameter -> its name in the checkpoint (vLLM's and speculators' names).
_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm": "layers.0.hidden_norm.weight",
    "input_layernorm": "layers.0.input_layernorm.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "mask_hidden": MASK_HIDDEN,
}
#: Weights a head may lack (a parallel head's only).
_OPTIONAL = {MASK_HIDDEN}


def save_head(head, out: Path) -> None:
    """``config.json`` and ``model.safetensors`` into ``out``: a head vLLM loads as it is."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {
        _NAMES[k]: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k in _NAMES
    }
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head.config, indent=2) + "\n")


def load_head(path: str, target_dir: str):
    """A head written by :func:`save_head` (or any Llama EAGLE-3 head with the full vocabulary),
    in fp32, over the target's embedding."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    head = _module()(config, _target_weights(target_dir)["embed"])
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    back = {v: k for k, v in _NAMES.items()}
    missing = [name for name in _NAMES.values() if name not in state and name not in _OPTIONAL]
    if missing:
        raise ValueError(f"{path}: the head's weights lack {', '.join(missing)}")
    if head.mask_hidden is None:
        state.pop(MASK_HIDDEN, None)  # no mask token named: vLLM drafts a token a pass and skips it
    elif MASK_HIDDEN not in state:
        state[MASK_HIDDEN] = head.mask_hidden.detach().clone()  # named in the config, not trained yet
    else:
        state[MASK_HIDDEN] = state[MASK_HIDDEN].reshape(head.mask_hidden.shape)
    head.load_state_dict({back[k]: v.float() for k, v in state.items() if k in back}, strict=True)
    head.config = config
    return head


# --------------------------------------------------------------------------- training


def _load_chunk(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _batches(files: list[Path], batch_size: int, rng: random.Random) -> Iterator[dict]:
    """Batches of sequences, endlessly, one chunk file in memory at a time (chunks in a fresh
    random order each pass, sequences shuffled within a chunk)."""
    while True:
        order = list(files)
        rng.shuffle(order)
        for path in order:
            chunk = _load_chunk(path)
            idx = list(range(chunk["tokens"].shape[0]))
            rng.shuffle(idx)
            for i in range(0, len(idx), batch_size):
                yield _take(chunk, idx[i : i + batch_size], SPAN, rng)


def _take(chunk: dict, idx: list[int], span: int | None = None, rng: random.Random | None = None) -> dict:
    """The sequences ``idx`` of a chunk; with ``span``, a random span of at most that many
    tokens of each (the whole of a shorter one). ``prompts``: each one's prompt tokens in what
    is taken (none where a chunk written before they were recorded)."""
    import torch

    sel = torch.tensor(idx)
    lengths = chunk["lengths"][sel].long()
    prompts = chunk["prompts"][sel].long() if "prompts" in chunk else torch.zeros_like(lengths)
    width = int(lengths.max())
    if span is None or width <= span:
        return {
            "tokens": chunk["tokens"][sel, :width].long(),
            "lengths": lengths,
            "prompts": prompts,
            "labels": chunk["labels"][sel, :width].long(),
            "aux": chunk["aux"][sel, :width],
        }
    starts = [(rng or random).randint(0, max(0, int(n) - span)) for n in lengths]
    rows = torch.tensor(idx).unsqueeze(1)
    cols = torch.tensor(starts).unsqueeze(1) + torch.arange(span)
    cols = cols.clamp(max=chunk["tokens"].shape[1] - 1)
    return {
        "tokens": chunk["tokens"][rows, cols].long(),
        "lengths": (lengths - torch.tensor(starts)).clamp(max=span),
        "prompts": (prompts - torch.tensor(starts)).clamp(min=0),
        "labels": chunk["labels"][rows, cols].long(),
        "aux": chunk["aux"][rows, cols],
    }


def step_losses(head, batch: dict, steps: int = TTT_STEPS) -> tuple[Any, list, int]:
    """(the weighted loss, right-in-a-row counts per step, the positions step 0 drafts at) of a
    batch."""
    import torch
    import torch.nn.functional as F

    tokens, labels, lengths = batch["tokens"], batch["labels"], batch["lengths"]
    length = tokens.shape[1]
    if length < 3:
        zero = head.fc.weight.sum() * 0.0
        return zero, [0] * steps, 0
    logits = head.unroll(tokens, batch["aux"], steps)
    pos = torch.arange(length - 1, device=tokens.device)
    total, weight = 0.0, 0.0
    run = torch.ones(tokens.shape[0], length - 1, dtype=torch.bool, device=tokens.device)
    right, positions = [], 0
    for s, step_logits in enumerate(logits):
        where = pos + 1 + s
        valid = where.unsqueeze(0) < lengths.unsqueeze(1)
        label = labels[:, where.clamp(max=length - 1)]
        if valid.any():
            loss = F.cross_entropy(step_logits[valid], label[valid])
            total = total + (STEP_DECAY**s) * loss
            weight += STEP_DECAY**s
        run = run & (step_logits.argmax(-1) == label) & valid
        right.append(int(run.sum()))
        if s == 0:
            positions = int(valid.sum())
    return total / max(weight, 1e-9), right, positions


def _on(batch: dict, device: str) -> dict:
    """A batch's tensors on ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def expected_accepted(
    head, files: list[Path], batch_size: int = 16, steps: int = TTT_STEPS, parallel_k: int | None = None
) -> float:
    """Mean over held-out positions of the tokens the head gets right in a row, up to
    ``steps``: the tokens a greedy verification would accept per step beyond the target's own.
    ``parallel_k``: drafting in parallel instead, the tokens right in a row of the ``parallel_k``
    one pass proposes, from :data:`EVAL_POINTS` points spread over each sequence where vLLM
    drafts (:func:`draft_points`). On the head's device, in bf16 autocast there where it is CUDA
    (as it trains)."""
    import torch

    from batchspec.distill.device import autocast

    device = head.fc.weight.device.type
    spread = (torch.arange(EVAL_POINTS) + 0.5) / EVAL_POINTS
    right_total, positions = 0, 0
    head.eval()
    with torch.no_grad(), autocast(device):
        for path in files:
            chunk = _load_chunk(path)
            n = chunk["tokens"].shape[0]
            for i in range(0, n, batch_size):
                batch = _take(chunk, list(range(i, min(n, i + batch_size))))
                if parallel_k:
                    points = draft_points(batch, spread.expand(len(batch["lengths"]), -1))
                    _, right, counted = parallel_losses(head, _on(batch, device), parallel_k, points)
                else:
                    _, per_step, counted = step_losses(head, _on(batch, device), steps)
                    right = sum(per_step)
                right_total += right
                positions += counted
    head.train()
    return right_total / positions if positions else 0.0


@dataclass
class HeadTrainResult:
    """What :func:`train_head` did; the validation figures are :func:`expected_accepted`'s
    (the names are distill's for draft models, whose figure is top-1 agreement)."""

    steps: int
    loss: float | None
    wall_s: float
    best_step: int | None = None
    validation_agreement: float | None = None
    start_validation_agreement: float | None = None
    stopped_early: bool = False
    stopped_by_time: bool = False
    history: list = field(default_factory=list)
    top1_agreement: float | None = None
    device: str = "cpu"
    #: What validation_agreement measures.
    metric: str = f"held-out tokens right in a row, of {TTT_STEPS} draft steps"


def train_head(
    head,
    files: list[Path],
    validation: list[Path],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    say: Callable[[str], None] | None = None,
    patience: int = 3,
    deadline: float | None = None,
    interval_s: float = 10.0,
    device: str | None = None,
    parallel_k: int | None = None,
) -> HeadTrainResult:
    """Train ``head`` in place (AdamW, warm-up then cosine); keep the weights with the best
    held-out :func:`expected_accepted`, measured about 20 times over the run, and stop after
    ``patience`` measurements without a new best, or at ``deadline`` (time.monotonic).
    ``device``: as the draft trainer's (:func:`batchspec.distill.train.train_draft`): bf16
    autocast with fp32 master weights on CUDA, fp32 on at most MAX_TORCH_THREADS threads on
    the CPU; None: CUDA where present. ``parallel_k``: train a parallel head (P-EAGLE) drafting
    this many tokens a pass (:func:`parallel_losses`, measured by
    :func:`expected_accepted`). The head is back on the CPU when this returns."""
    import torch

    from batchspec.distill import device as devices
    from batchspec.distill.recipe import lr_at
    from batchspec.distill.train import MAX_TORCH_THREADS, EarlyStop, eval_interval

    say = say or (lambda msg: None)
    device = device or devices.resolve("auto")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = last = time.monotonic()
    watch = EarlyStop(patience)
    every = eval_interval(steps)
    history: list[tuple[int, float]] = []
    best_state = None
    run, loss_value, by_time = 0, None, False

    def check(step: int) -> None:
        nonlocal best_state
        value = expected_accepted(head, validation, batch_size, parallel_k=parallel_k)
        history.append((step, round(value, 4)))
        if watch.record(step, value):
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()}
        say(
            f"held-out tokens right in a row at step {step}: {value:.3f} (best {watch.best:.3f} at "
            f"step {watch.best_step})"
        )

    with devices.cpu_threads(device, MAX_TORCH_THREADS):
        head.to(device)
        head.train()
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        warmup = max(1, min(50, steps // 10))
        if validation:
            check(0)
        batches = _batches(files, batch_size, rng)
        points = torch.Generator().manual_seed(seed)
        for step in range(steps):
            if deadline is not None and time.monotonic() > deadline:
                by_time = True
                say(f"--max-minutes reached: training stopped at step {run} of {steps}")
                break
            with devices.autocast(device):
                if parallel_k:
                    loss, _, _ = parallel_losses(head, _on(next(batches), device), parallel_k, gen=points)
                else:
                    loss, _, _ = step_losses(head, _on(next(batches), device))
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            run, loss_value = step + 1, float(loss.item())
            now = time.monotonic()
            if now - last >= interval_s or step in (0, steps - 1):
                last = now
                per = (now - started) / run
                say(
                    f"train step {run}/{steps}: loss {loss_value:.3f} ({now - started:.0f}s, "
                    f"about {per * (steps - run):.0f}s left)"
                )
            if validation and (run % every == 0 or run == steps):
                check(run)
                if watch.stop:
                    say(
                        f"held-out acceptance has not risen for {watch.patience} evaluations: "
                        f"stopped at step {run} of {steps}"
                    )
                    break
        if validation and run and (not history or history[-1][0] != run):
            check(run)
        if best_state is not None:
            head.load_state_dict(best_state)
            if watch.best_step != run:
                say(f"kept the weights of step {watch.best_step} (held-out {watch.best:.3f})")
        head.eval()
        head.to("cpu")
    if device == "cuda":
        devices.release_gpu()
    return HeadTrainResult(
        steps=run,
        loss=loss_value,
        wall_s=time.monotonic() - started,
        best_step=watch.best_step,
        validation_agreement=None if watch.best is None else round(watch.best, 4),
        start_validation_agreement=history[0][1] if history else None,
        stopped_early=bool(validation) and run < steps and not by_time,
        stopped_by_time=by_time,
        history=history,
        device=device,
        metric=(
            f"held-out tokens right in a row, of {parallel_k} drafted in one pass"
            if parallel_k
            else HeadTrainResult.metric
        ),
    )


def target_config(target_dir: str) -> dict:
    """The target's (language model's) config."""
    return text_config(json.loads((Path(target_dir) / "config.json").read_text()))
