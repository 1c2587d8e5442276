"""What a model checkpoint is, read from its ``config.json`` alone: a draft model, or a head
(EAGLE, EAGLE-3) on the target's hidden states.

A checkpoint says what it is: speculators' format names its algorithm
(``speculators_model_type``), vLLM's own head formats name an ``Eagle``/``Eagle3`` architecture,
and anything else is a draft model. batchspec never guesses a method from a directory's name.
No torch, no vLLM: the spec's shorthand (a ``speculative.model`` without a method), ``tune`` and
``speculative: auto`` use it before any engine exists.

A config.json is untrusted input: :func:`load_config` is the one place that reads one (at most
:data:`MAX_CONFIG_BYTES`, never through a FIFO, a loop or a directory) and checks the type of
every field batchspec reads (:func:`config_problem`), refusing with SpecError naming the
caller's key. :func:`read_config` is its lenient twin for callers that only ask what a
checkpoint is."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from batchspec.errors import SpecError, quoted
from batchspec.spec.methods import DRAFT_MODEL, detect

#: The most bytes of a config.json read. Real ones are a few kB (a multimodal model's, with its
#: vision and text configs, some tens of kB); this is a hundredfold margin.
MAX_CONFIG_BYTES = 4 * 2**20

#: The largest width, vocabulary or layer count taken. Real ones are far below; this keeps a
#: huge JSON integer out of the arithmetic that follows.
MAX_COUNT = 2**31 - 1

#: Fields that must be positive whole numbers where given (null: not given).
COUNT_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_hidden_layers")
#: Sections read as configs of their own: the language model's, the head's layer, EAGLE's.
SECTIONS = ("text_config", "transformer_layer_config", "eagle_config")
AUX_IDS = "eagle_aux_hidden_state_layer_ids"


def local_path(model: Any) -> Path | None:
    """The local path ``model`` names where something is there (a broken or looping symlink
    included), or None: a hub id, a URL, nothing at that path."""
    if not isinstance(model, str) or not model or "://" in model or "\0" in model:
        return None
    path = Path(model).expanduser()
    return path if os.path.lexists(path) else None


def missing_path(model: Any) -> str | None:
    """Why ``model`` names nothing vLLM could load, or None: a path (absolute, or starting with
    ``~`` or ``.``, as no model id does) with nothing there, which vLLM would try as a model id
    and fail on after its start-up."""
    if not isinstance(model, str) or not model.startswith(("/", "~", ".")) or "\0" in model:
        return None
    if os.path.lexists(Path(model).expanduser()):
        return None
    return f"{model}: no such file or directory (a path, not a model id)"


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list"}.get(type(value), type(value).__name__)


def open_regular(path: Path) -> int:
    """A descriptor on ``path`` where it is a regular file. O_NONBLOCK: a FIFO planted in its
    place opens at once (and is refused) instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise OSError(f"{path.name} is not a regular file")
    return fd


def parse_json(data: bytes) -> Any:
    """JSON, with nesting too deep for the parser's recursion as a ValueError."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deep") from None


class _ConfigFileError(Exception):
    """A config.json that cannot be read or is not a JSON object (the message says which)."""


def _read_config_file(directory: Path) -> dict | None:
    """``directory``'s config.json as an object, None where there is none; _ConfigFileError
    for one that is no config."""
    file = directory / "config.json"
    if not os.path.lexists(file):
        return None
    try:
        fd = open_regular(file)
    except OSError:
        raise _ConfigFileError("its config.json is not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise _ConfigFileError(f"its config.json cannot be read ({exc.strerror})") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise _ConfigFileError(
            f"its config.json is over the {MAX_CONFIG_BYTES // 2**20} MiB a config.json may hold"
        )
    try:
        value = parse_json(data)
    except ValueError as exc:
        raise _ConfigFileError(
            f"its config.json cannot be read as JSON ({type(exc).__name__}: {quoted(str(exc))})"
        ) from exc
    if not isinstance(value, dict):
        raise _ConfigFileError(f"its config.json holds a JSON {_json_kind(value)}, not an object")
    return value


def read_config(model: Any) -> dict | None:
    """A local model directory's ``config.json`` as read, or None (a hub id, a URL, no
    config, one that is not a JSON object). Its fields are not checked:
    :func:`checkpoint_method` takes any, and the checks call :func:`load_config`."""
    path = local_path(model)
    if path is None or not path.is_dir():
        return None
    try:
        return _read_config_file(path)
    except _ConfigFileError:
        return None


def load_config(model: Any, key: str | None, gguf: bool = False) -> dict | None:
    """A local model directory's ``config.json``, read within :data:`MAX_CONFIG_BYTES` and its
    fields checked, or None where batchspec cannot read one before vLLM: a hub id, a URL, a
    path with nothing there, a directory without a config.json, and (``gguf``) a ``.gguf``
    file, which vLLM loads as it is. Anything else at a local path (a file, a broken or looping
    symlink, a config.json that is no JSON object or has a field of the wrong type) raises
    SpecError naming ``key``."""
    path = local_path(model)
    if path is None:
        return None
    try:
        path.stat()
    except OSError as exc:
        raise SpecError(key, f"{model}: cannot be read ({exc.strerror})") from exc
    if not path.is_dir():
        if gguf and path.suffix.lower() == ".gguf" and path.is_file():
            return None
        raise SpecError(key, f"{model}: not a model directory (a file, not a directory with a config.json)")
    try:
        config = _read_config_file(path)
    except _ConfigFileError as exc:
        raise SpecError(key, f"{model}: {exc}") from exc
    if config is None:
        return None
    problem = config_problem(config)
    if problem is not None:
        raise SpecError(key, f"{model}: {problem}")
    return config


def _count_problem(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        return f"{name} is {quoted(value)}, not a positive whole number (up to {MAX_COUNT})"
    return None


def _section_problem(config: dict, prefix: str) -> str | None:
    for name in ("speculators_model_type", "model_type"):
        value = config.get(name)
        if value is not None and not isinstance(value, str):
            return f"{prefix}{name} is {quoted(value)}, not a string"
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        return f"{prefix}architectures is {quoted(archs)}, not a list of names"
    for name in COUNT_FIELDS:
        problem = _count_problem(prefix + name, config.get(name))
        if problem:
            return problem
    ids = config.get(AUX_IDS)
    # each id is checked against the target's layers (batchspec.engine.heads)
    if ids is not None and not isinstance(ids, list):
        return f"{prefix}{AUX_IDS} is {quoted(ids)}, not a list of layer ids"
    return None


def config_problem(config: dict) -> str | None:
    """The first field batchspec reads that has the wrong type, in words naming it (dotted
    within its section), or None. Every field read from a config is checked here: the rest
    of this module and batchspec.engine.heads take the types as given."""
    problem = _section_problem(config, "")
    if problem:
        return f"its config.json's {problem}"
    for section in SECTIONS:
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            return f"its config.json's {section} is {quoted(value)}, not an object"
        problem = _section_problem(value, f"{section}.")
        if problem:
            return f"its config.json's {problem}"
    return None


def text_config(config: dict) -> dict:
    """The language model's part of a config (``text_config`` of a multimodal one, else itself)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def checkpoint_method(config: dict) -> str:
    """``eagle3``, ``eagle`` or ``draft_model``: what a checkpoint's config says it is, as each
    method describes itself (:func:`batchspec.spec.methods.detect`). Takes a config whose fields
    have any type (a mistyped one is :func:`load_config`'s to refuse)."""
    return detect(config)


def method_of(model: str) -> str:
    """The method a local checkpoint calls for (``draft_model`` for a hub id or a URL, which
    batchspec cannot read before vLLM does, and for a config it cannot read, which the checks
    then refuse naming the key)."""
    config = read_config(model)
    return DRAFT_MODEL.name if config is None else checkpoint_method(config)


def head_layer_config(config: dict) -> dict:
    """The head's own transformer-layer config: speculators' ``transformer_layer_config`` with
    the algorithm's fields on top (as vLLM reads it), or the config itself."""
    layer = config.get("transformer_layer_config")
    if isinstance(layer, dict):
        merged = dict(layer)
        for key in ("draft_vocab_size", "target_hidden_size", AUX_IDS):
            if config.get(key) is not None:
                merged[key] = config[key]
        return merged
    return config


def aux_layer_ids(config: dict, target_layers: int) -> list:
    """EAGLE-3's auxiliary layer ids as vLLM takes them: the config's (top level or
    ``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)``."""
    ids = config.get(AUX_IDS)
    if not ids and isinstance(config.get("eagle_config"), dict):
        ids = config["eagle_config"].get(AUX_IDS)
    if ids:
        return list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return [2, target_layers // 2, target_layers - 3]
