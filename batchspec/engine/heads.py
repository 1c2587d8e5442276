"""Speculative models that are not draft models: EAGLE heads on the target's hidden states.

A head (EAGLE, EAGLE-3) is one decoder layer that reads the target's own hidden states, so it
fits one target only: its width must be the target's, its vocabulary the target's (or a smaller
draft vocabulary with its mapping), and EAGLE-3's auxiliary layers must exist in the target.
vLLM checks little of this before it loads the weights, and what it misses fails deep inside
its model runner. :func:`check_speculative_model` reads both configs (JSON, and the weight files'
headers only) and refuses a mismatch with exit 2 naming the key, before any weights load.

What a checkpoint is comes from :mod:`batchspec.spec.checkpoints`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from batchspec.errors import SpecError
from batchspec.spec.checkpoints import (
    HEAD_METHODS,
    aux_layer_ids,
    checkpoint_method,
    config_problem,
    head_layer_config,
    read_config,
    text_config,
)


def weight_shapes(directory: Path) -> dict[str, list[int]]:
    """Every tensor's shape in a directory's safetensors files, from their headers only."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > 100 * 2**20:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
        except (OSError, ValueError, struct.error) as exc:
            raise SpecError(None, f"{file.name} is not a readable safetensors file: {exc}") from exc
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                shapes[name] = list(info.get("shape") or ())
    return shapes


def _read_tensor(directory: Path, name: str):
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def check_speculative_model(
    target: str, speculative: dict | None, key: str = "speculative", where: str | None = None
) -> None:
    """Refuse, with SpecError naming ``key``'s fields, a speculative model that cannot serve
    ``target``: a head given as a draft model or a draft model given as a head, and a head whose
    width, vocabulary or auxiliary layers do not fit the target. Only what can be read
    locally is checked (a hub id or a URL goes to vLLM as it is)."""
    if not speculative or not isinstance(speculative, dict):
        return
    model = speculative.get("model")
    method = speculative.get("method")
    named = where or f"{key}.model"
    problem = config_problem(model)
    if problem is not None:
        raise SpecError(named, f"{model}: {problem}")
    config = read_config(model)
    if config is None:
        return
    found = checkpoint_method(config)
    if method == "draft_model" and found in HEAD_METHODS:
        raise SpecError(
            f"{key}.method",
            f"{model} is an {found.upper()} head (its config.json says so), not a draft model: "
            f"use method: {found}",
        )
    if method in HEAD_METHODS and found == "draft_model":
        raise SpecError(
            f"{key}.method",
            f"{model} is a draft model (architectures {config.get('architectures')}), not an "
            f"{method.upper()} head: use method: draft_model",
        )
    if method in HEAD_METHODS and found in HEAD_METHODS and found != method:
        raise SpecError(f"{key}.method", f"{model} is an {found.upper()} head: use method: {found}")
    if method not in HEAD_METHODS:
        return
    target_config = read_config(target)
    if target_config is None:
        return
    try:
        check_head_fits(Path(model).expanduser(), config, text_config(target_config), method, named)
    except SpecError as exc:
        if exc.key is not None:
            raise
        raise SpecError(named, f"{model}: {exc}") from exc


def check_head_with_lora(has_lora: bool, method: str | None, key: str = "model.lora") -> None:
    """Refuse a head beside LoRA adapters: vLLM 0.32 gives a head without an embedding of its own
    (or with one equal to the target's, which is what speculators' heads and batchspec's are)
    the target's embedding layer, which with LoRA enabled is the adapter-wrapped one; the head's
    draft step then runs it with the target's token-to-adapter mapping and the engine fails
    (``einsum(): subscript b has size ...``, seen on the CPU build with the adapters of
    ``make models``). Refused before any weights load, naming ``key``."""
    if has_lora and method in HEAD_METHODS:
        raise SpecError(
            key,
            f"LoRA adapters cannot run beside an {method.upper()} head on vLLM 0.32: the head shares "
            "the target's embedding, which LoRA wraps, and the engine fails on the head's first "
            "draft step; use a draft model (method: draft_model) or ngram with adapters, or run "
            "without them",
        )


def check_head_fits(directory: Path, config: dict, target: dict, method: str, key: str) -> None:
    """The head at ``directory`` (its ``config``) against the target's config."""
    head = head_layer_config(config)
    for name in ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_hidden_layers"):
        value = head.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(key, f"the head's {name} is {value!r}, not a positive whole number")
    t_hidden, t_vocab = target.get("hidden_size"), target.get("vocab_size")
    t_layers = target.get("num_hidden_layers")
    hidden = head.get("hidden_size")
    if hidden is not None and t_hidden is not None and hidden != t_hidden:
        raise SpecError(
            key,
            f"the head's hidden_size is {hidden} and the target's {t_hidden}: a head reads the "
            "target's token embeddings beside its hidden states, so the two must be equal (this "
            "head was made for another target)",
        )
    fed = head.get("target_hidden_size", hidden)
    if fed is not None and t_hidden is not None and fed != t_hidden:
        raise SpecError(
            key,
            f"the head's target_hidden_size is {fed} and the target's hidden_size {t_hidden}: "
            "this head was made for another target",
        )
    vocab = head.get("vocab_size")
    if vocab is not None and t_vocab is not None and vocab != t_vocab:
        raise SpecError(
            key,
            f"the head's vocab_size is {vocab} and the target's {t_vocab}: a head proposes the "
            "target's own token ids, so the vocabularies must be the same",
        )
    draft_vocab = head.get("draft_vocab_size") or vocab
    shapes = weight_shapes(directory)
    if draft_vocab is not None and t_vocab is not None and draft_vocab != t_vocab:
        if draft_vocab > t_vocab:
            raise SpecError(
                key,
                f"the head's draft_vocab_size ({draft_vocab}) is larger than the target's "
                f"vocabulary ({t_vocab})",
            )
        if shapes.get("d2t") != [draft_vocab]:
            raise SpecError(
                key,
                f"the head's draft vocabulary ({draft_vocab} tokens) is smaller than the "
                f"target's ({t_vocab}), and its weights hold no d2t mapping of {draft_vocab} "
                f"entries (found {shapes.get('d2t')}): vLLM could not map its tokens to the target's",
            )
        import torch

        d2t = _read_tensor(directory, "d2t")
        ids = d2t + torch.arange(draft_vocab, dtype=d2t.dtype)
        if int(ids.min()) < 0 or int(ids.max()) >= t_vocab:
            raise SpecError(
                key,
                f"the head's d2t mapping sends draft tokens to ids outside the target's "
                f"vocabulary (0..{t_vocab - 1})",
            )
    lm_head = shapes.get("lm_head.weight")
    if lm_head and draft_vocab is not None and lm_head[0] != draft_vocab:
        raise SpecError(
            key,
            f"the head's lm_head has {lm_head[0]} rows and its config a draft vocabulary of "
            f"{draft_vocab}: the checkpoint does not match its own config",
        )
    if method != "eagle3" or not isinstance(t_layers, int):
        return
    given = head.get("eagle_aux_hidden_state_layer_ids")
    if given is not None and not isinstance(given, (list, tuple)):
        raise SpecError(
            key, f"the head's eagle_aux_hidden_state_layer_ids is {given!r}, not a list of layer ids"
        )
    ids = aux_layer_ids(head, t_layers)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < t_layers]
    if bad:
        raise SpecError(
            key,
            f"the head's eagle_aux_hidden_state_layer_ids {ids} name layers the target does not "
            f"have: it has {t_layers} (ids 0..{t_layers - 1})"
            + ("" if head.get("eagle_aux_hidden_state_layer_ids") else " (vLLM's default: none set)"),
        )
    fc = shapes.get("fc.weight")
    if fc and t_hidden and len(fc) == 2 and fc[1] != len(ids) * t_hidden:
        raise SpecError(
            key,
            f"the head's fc takes {fc[1]} inputs and {len(ids)} auxiliary layers of the target give "
            f"{len(ids) * t_hidden}: its eagle_aux_hidden_state_layer_ids do not match its weights",
        )
