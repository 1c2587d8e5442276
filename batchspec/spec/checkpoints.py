"""What a model checkpoint is, read from its ``config.json`` alone: a draft model, or a head
(EAGLE, EAGLE-3) on the target's hidden states.

A checkpoint says what it is: speculators' format names its algorithm
(``speculators_model_type``), vLLM's own head formats name an ``Eagle``/``Eagle3`` architecture,
and anything else is a draft model. batchspec never guesses a method from a directory's name.
No torch, no vLLM: the spec's shorthand (a ``speculative.model`` without a method), ``tune`` and
``speculative: auto`` use it before any engine exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The methods whose model reads the target's hidden states.
HEAD_METHODS = ("eagle", "eagle3")


def _local_dir(model: Any) -> Path | None:
    if not isinstance(model, str) or "://" in model:
        return None
    path = Path(model).expanduser()
    return path if (path / "config.json").is_file() else None


def read_config(model: Any) -> dict | None:
    """A local model directory's ``config.json``, or None (a hub id, a URL, no config)."""
    path = _local_dir(model)
    if path is None:
        return None
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def config_problem(model: Any) -> str | None:
    """What is wrong with a local model directory's ``config.json`` (not JSON, not an object),
    or None (fine, or not a local directory)."""
    path = _local_dir(model)
    if path is None:
        return None
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read as JSON ({type(exc).__name__}: {exc})"
    return (
        None
        if isinstance(value, dict)
        else f"its config.json holds a JSON {type(value).__name__}, not an object"
    )


def text_config(config: dict) -> dict:
    """The language model's part of a config (``text_config`` of a multimodal one, else itself)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def checkpoint_method(config: dict) -> str:
    """``eagle3``, ``eagle`` or ``draft_model``: what a checkpoint's config says it is."""
    kind = config.get("speculators_model_type")
    if isinstance(kind, str) and kind:
        return {"peagle": "eagle3"}.get(kind, kind)
    archs = [a for a in config.get("architectures") or () if isinstance(a, str)]
    if any("eagle3" in a.lower() for a in archs):
        return "eagle3"
    if any("eagle" in a.lower() for a in archs) or config.get("model_type") == "eagle":
        return "eagle"
    return "draft_model"


def method_of(model: str) -> str:
    """The method a local checkpoint calls for (``draft_model`` for a hub id or a URL, which
    batchspec cannot read before vLLM does)."""
    config = read_config(model)
    return "draft_model" if config is None else checkpoint_method(config)


def head_layer_config(config: dict) -> dict:
    """The head's own transformer-layer config: speculators' ``transformer_layer_config`` with
    the algorithm's fields on top (as vLLM reads it), or the config itself."""
    layer = config.get("transformer_layer_config")
    if isinstance(layer, dict):
        merged = dict(layer)
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if config.get(key) is not None:
                merged[key] = config[key]
        return merged
    return config


def aux_layer_ids(config: dict, target_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layer ids as vLLM takes them: the config's (top level or
    ``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)``."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(config.get("eagle_config"), dict):
        ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return [2, target_layers // 2, target_layers - 3]
