"""The features an EAGLE-3 head trains on (:mod:`batchspec.distill.eagle3`): the target's hidden
states at the head's auxiliary layers and its greedy next token, at every position of each
prompt and continuation, from the target's own forward pass in transformers.

vLLM's auxiliary state at layer ``i`` is the residual stream entering layer ``i``
(transformers' ``hidden_states[i]``): a forward pre-hook on each auxiliary layer keeps that
input and nothing else (``output_hidden_states`` would hold every layer's), and the logits at
the last layer, whose argmax are the labels, are computed a few sequences at a time
(:func:`batchspec.distill.device.label_rows`). Why not vLLM's own hidden-state extraction:
docs/speculation.md (Heads).

Where (``--device``, :mod:`batchspec.distill.device`): on the CPU the target runs in float32,
each chunk file's sequences in one pass. On CUDA it is loaded in bf16 once the generating
engine's GPU memory is seen free, and each chunk runs in passes of as many sequences as the
memory left beside the weights holds (:func:`batchspec.distill.device.feature_rows`).

The features stream to disk in chunk files of ``chunk_rows`` sequences (float16, safetensors),
kept under the work directory: a restart with the same rows reuses them. Training reads one
chunk at a time, so memory is bounded by a chunk whatever the sample."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchspec.distill import device as devices

#: Tokens of a sequence (prompt and continuation) kept for training.
MAX_TOKENS = 512
#: Sequences per chunk file.
CHUNK_ROWS = 32


@dataclass
class Features:
    """The chunk files of one sample's features, and what they hold."""

    files: list[Path]
    sequences: int
    tokens: int


class Target:
    """The target, for its features: loaded on first use on ``device`` (on CUDA in bf16, after
    :func:`~batchspec.distill.device.wait_for_gpu_memory`), released by :meth:`close`."""

    def __init__(self, target_dir: str, device: str = "cpu", say: Callable[[str], None] | None = None):
        self.target_dir = target_dir
        self.device = device
        self.say = say or (lambda msg: None)
        self.model: Any = None
        #: GPU memory free once the weights are loaded (the passes are sized to it).
        self.free: int | None = None

    def load(self) -> Any:
        if self.model is not None:
            return self.model
        import torch
        from transformers import AutoModelForCausalLM

        if self.device == "cuda":
            needed = devices.weight_bytes(self.target_dir) + devices.FORWARD_RESERVE
            devices.wait_for_gpu_memory(needed, "the target in bf16 for its hidden states", self.say)
            model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.bfloat16)
            self.model = model.to("cuda").eval()
            self.free = int(torch.cuda.mem_get_info()[0])
            self.say(f"the target is on the GPU: {self.free / (1 << 30):.1f} GiB left for its forward passes")
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()
        return self.model

    def rows_per_pass(self, width: int, layers_kept: int) -> int | None:
        """Sequences of ``width`` tokens one forward pass takes (None: all of a chunk's, the CPU)."""
        if self.device != "cuda" or self.free is None:
            return None
        hidden = int(self.model.config.get_text_config().hidden_size)
        return devices.feature_rows(self.free, hidden, layers_kept, width)

    def features(self, ids, mask, aux_layers: list[int]) -> tuple[Any, Any]:
        """(the auxiliary layers' states, float16, and the greedy next tokens, int32) of right-
        padded ``ids`` with ``mask``, both on the CPU, computed in passes sized to the device."""
        import torch

        model = self.load()
        per_pass = self.rows_per_pass(ids.shape[1], len(aux_layers)) or ids.shape[0]
        aux, labels = [], []
        with torch.inference_mode():
            for first in range(0, ids.shape[0], per_pass):
                part = slice(first, first + per_pass)
                a, lab = forward_pass(
                    model, ids[part].to(self.device), mask[part].to(self.device), aux_layers
                )
                aux.append(a.to("cpu", torch.float16))
                labels.append(lab.to("cpu", torch.int32))
        return torch.cat(aux), torch.cat(labels)

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            devices.release_gpu()


def forward_pass(model, ids, mask, aux_layers: list[int]) -> tuple[Any, Any]:
    """One forward pass of a causal LM over ``ids``: the inputs of its decoder layers
    ``aux_layers``, concatenated (B, T, len x hidden), and the argmax of its logits (B, T)."""
    import torch

    decoder = model.get_decoder()
    kept: dict[int, Any] = {}

    def keep(i: int):
        def hook(module, args, kwargs):
            kept[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    layers = decoder.layers
    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in set(aux_layers)]
    try:
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([kept[i] for i in aux_layers], dim=-1)
    head = model.get_output_embeddings()
    step = devices.label_rows(head.weight.shape[0], ids.shape[1])
    labels = torch.cat([head(hidden[j : j + step]).argmax(-1) for j in range(0, ids.shape[0], step)])
    return aux, labels


def collect_features(
    target_dir: str,
    rows: list[dict],
    aux_layers: list[int],
    directory: Path,
    chunk_rows: int = CHUNK_ROWS,
    say: Callable[[str], None] | None = None,
    deadline: float | None = None,
    target: Target | None = None,
) -> Features:
    """The target's hidden states at ``aux_layers`` and its greedy next token, at every position
    of each row's prompt and continuation, written as chunk files into ``directory`` (kept, and
    reused by a restart with the same rows). One chunk in memory at a time. ``target``: the
    target already set up for a device (loaded once for several samples; the caller closes
    it); else one on the CPU, closed here."""
    import torch
    from safetensors.torch import save_file

    say = say or (lambda msg: None)
    own = target is None
    target = target or Target(target_dir, "cpu", say)
    directory.mkdir(parents=True, exist_ok=True)
    chunks = [rows[i : i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    files, tokens_total = [], 0
    started = time.monotonic()
    try:
        for n, chunk in enumerate(chunks):
            path = directory / f"features-{n:05d}.safetensors"
            seqs = [[*r["prompt_token_ids"], *r["output_token_ids"]][:MAX_TOKENS] for r in chunk]
            if path.is_file():
                files.append(path)
                tokens_total += sum(len(s) for s in seqs)
                continue
            if deadline is not None and time.monotonic() > deadline:
                say(f"--max-minutes reached: features of {n} of {len(chunks)} chunks collected")
                break
            tokens_total += sum(len(s) for s in seqs)
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            aux, labels = target.features(ids, mask, aux_layers)
            prompts = [min(len(r["prompt_token_ids"]), len(s)) for r, s in zip(chunk, seqs, strict=True)]
            tensors = {
                "tokens": ids.to(torch.int32),
                "lengths": mask.sum(1).to(torch.int32),
                "prompts": torch.tensor(prompts, dtype=torch.int32),
                "labels": labels,
                "aux": aux.contiguous(),
            }
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
            files.append(path)
            done = n + 1
            elapsed = time.monotonic() - started
            say(
                f"features: chunk {done}/{len(chunks)} ({elapsed:.0f}s, about "
                f"{elapsed / done * (len(chunks) - done):.0f}s left)"
            )
    finally:
        if own:
            target.close()
    return Features(files=files, sequences=sum(len(c) for c in chunks[: len(files)]), tokens=tokens_total)
