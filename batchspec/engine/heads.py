"""Speculative models that are not draft models: EAGLE heads on the target's hidden states.

A head (EAGLE, EAGLE-3) is one decoder layer that reads the target's own hidden states, so it
fits one target only: its width must be the target's, its vocabulary the target's (or a smaller
draft vocabulary with its mapping), and EAGLE-3's auxiliary layers must exist in the target.
vLLM checks little of this before it loads the weights, and what it misses fails deep inside
its model runner. :func:`check_speculative_model` reads both configs (JSON, and the weight files'
headers only) and refuses a mismatch with exit 2 naming the key, before any weights load.

A head's files are untrusted input: its config.json is read and its fields' types checked by
:func:`batchspec.spec.checkpoints.load_config`; its weight files' headers are read here within
:data:`MAX_HEADER_BYTES` in all, one file at a time, and every entry checked the way the
safetensors library checks it when vLLM loads the file. What a checkpoint is comes from
:mod:`batchspec.spec.checkpoints`."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from batchspec.errors import SpecError, quoted
from batchspec.spec.checkpoints import (
    aux_layer_ids,
    config_problem,
    head_layer_config,
    load_config,
    open_regular,
    parse_json,
    text_config,
)
from batchspec.spec.methods import MASK_HIDDEN, detect, is_draft, mask_token, reads_hidden_states
from batchspec.spec.methods import method as method_named

#: The most header bytes read from a head's weight files, all of them together. A head's
#: header is a few kB (a dozen tensors); a large model's shard headers are tens to hundreds of
#: kB. Parsed, a header takes up to about 20 times its bytes, and one file's is dropped before
#: the next is read, so this bounds the check's memory to about 200 MB whatever files claim.
MAX_HEADER_BYTES = 8 * 2**20

#: Bytes per element of safetensors' dtypes (those that pack elements within a byte left out:
#: their sizes are the library's to check).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
#: The dtypes a d2t mapping may have (token id offsets are whole numbers), as struct formats.
INT_FORMATS = {"I8": "b", "U8": "B", "I16": "h", "U16": "H", "I32": "i", "U32": "I", "I64": "q", "U64": "Q"}
#: The tensors the checks read, of all a head's weight files hold.
CHECKED_TENSORS = ("d2t", "lm_head.weight", "fc.weight", MASK_HIDDEN)
#: safetensors' sizes and offsets are 64-bit: a larger number cannot be loaded.
_U64 = 2**64


#: Bytes of a d2t mapping read at a time (a multiple of every integer width).
_CHUNK = 2**20


@dataclass(frozen=True)
class Tensor:
    """One tensor's entry in a safetensors header: where its bytes are in ``file``."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    #: From the file's start.
    offset: int
    nbytes: int


def _shown(name: str) -> str:
    return name if len(name) <= 100 and name.isprintable() else quoted(name)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64


def _entry(file: Path, name: str, info, data_start: int, data_len: int) -> Tensor:
    """A header entry checked: its fields' types, its bytes within the file and as many as its
    shape and dtype make. ValueError says what is wrong."""
    if not isinstance(info, dict):
        raise ValueError(f"{_shown(name)} is {quoted(info)}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"{_shown(name)}'s dtype is {quoted(dtype)}, not a string")
    if not isinstance(shape, list) or not all(_whole(n) for n in shape):
        raise ValueError(f"{_shown(name)}'s shape is {quoted(shape)}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)) or (
        offsets[0] > offsets[1]
    ):
        raise ValueError(f"{_shown(name)}'s data_offsets are {quoted(offsets)}, not [begin, end]")
    if offsets[1] > data_len:
        raise ValueError(f"{_shown(name)}'s data runs past the end of the file (torn?)")
    per = DTYPE_BYTES.get(dtype)
    if per is not None:
        # stop once past the bytes there are: a long shape of huge sizes stays cheap
        size = per
        for n in shape:
            size *= n
            if size > data_len:
                break
        if size != offsets[1] - offsets[0]:
            raise ValueError(
                f"{_shown(name)}'s data_offsets hold {offsets[1] - offsets[0]} bytes and its shape "
                f"and dtype make {size if size <= data_len else f'over {data_len}'}"
            )
    return Tensor(file, dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])


def _read_header(file: Path, budget: int, wanted: set[str]) -> tuple[dict[str, Tensor], int]:
    """The wanted tensors of one safetensors file, and its header's length. The header is
    parsed and dropped here; only its offsets are kept, to check that the tensors' bytes
    follow each other from the header to the end of the file, as safetensors requires."""
    with os.fdopen(open_regular(file), "rb") as f:
        length = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError("torn: it ends inside its header's length")
        (size,) = struct.unpack("<Q", prefix)
        if size > budget:
            raise ValueError(
                f"a header of {size} bytes, over the {MAX_HEADER_BYTES // 2**20} MiB batchspec "
                "reads of a head's weight files' headers, all files together (a head's are a few kB)"
            )
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError(f"torn: its header of {size} bytes ends after {len(raw)}")
    header = parse_json(raw)
    del raw
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    data_start, data_len = 8 + size, length - 8 - size
    found: dict[str, Tensor] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"__metadata__ is {quoted(info)}, not an object of strings")
            continue
        tensor = _entry(file, name, info, data_start, data_len)
        begin = tensor.offset - data_start
        spans.append((begin, begin + tensor.nbytes))
        if name in wanted:
            found[name] = tensor
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ValueError(
                f"its tensors' data do not follow each other: one starts at byte {begin} of the data, "
                f"the one before it ends at {end}"
            )
        end = stop
    if end != data_len:
        raise ValueError(f"its tensors take {end} bytes and {data_len} follow its header")
    return found, size


def weight_tensors(directory: Path, key: str | None, names=CHECKED_TENSORS) -> dict[str, Tensor]:
    """The named tensors' entries in a directory's safetensors files, from their headers only.
    Every entry of every header is checked (a torn file, a mistyped entry, headers over
    :data:`MAX_HEADER_BYTES` in all are refused naming ``key``), and one file's header is
    dropped before the next is read."""
    wanted, found, budget = set(names), {}, MAX_HEADER_BYTES
    for file in sorted(directory.glob("*.safetensors")):
        try:
            tensors, used = _read_header(file, budget, wanted)
        except (OSError, ValueError) as exc:
            raise SpecError(key, f"{file.name} is not a readable safetensors file: {exc}") from exc
        budget -= used
        found.update(tensors)
    return found


def _d2t_ids(tensor: Tensor, key: str | None) -> tuple[int, int]:
    """The lowest and highest target id a d2t mapping gives (draft id ``i`` goes to
    ``i + d2t[i]``), read a chunk at a time from the tensor's bytes."""
    fmt = INT_FORMATS.get(tensor.dtype)
    if fmt is None:
        raise SpecError(
            key,
            f"the head's d2t holds {_shown(tensor.dtype)} values, not token ids (an integer type: "
            f"{', '.join(INT_FORMATS)})",
        )
    width = struct.calcsize("<" + fmt)
    low = high = None
    index, left = 0, tensor.nbytes
    try:
        with os.fdopen(open_regular(tensor.file), "rb") as f:
            f.seek(tensor.offset)
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk or len(chunk) % width:
                    raise ValueError("d2t's data ends before its header says (torn?)")
                left -= len(chunk)
                values = struct.unpack(f"<{len(chunk) // width}{fmt}", chunk)
                ids = [value + i for i, value in enumerate(values, index)]
                index += len(values)
                low = min(ids) if low is None else min(low, min(ids))
                high = max(ids) if high is None else max(high, max(ids))
    except (OSError, ValueError) as exc:
        raise SpecError(key, f"{tensor.file.name} is not a readable safetensors file: {exc}") from exc
    return (0, 0) if low is None else (low, high)


def check_speculative_model(
    target: str, speculative: dict | None, key: str = "speculative", where: str | None = None
) -> None:
    """Refuse, with SpecError naming ``key``'s fields, a speculative model that cannot serve
    ``target``: a head given as a draft model or a draft model given as a head, a local path
    that is no model directory or whose config.json is no config, and a head whose width,
    vocabulary, auxiliary layers or weight files do not fit the target. Only what can be read
    locally is checked (a hub id or a URL goes to vLLM as it is)."""
    if not speculative or not isinstance(speculative, dict):
        return
    model = speculative.get("model")
    method = speculative.get("method")
    named = where or f"{key}.model"
    head = reads_hidden_states(method)
    config = load_config(model, named, gguf=not head)
    if config is None:
        return
    found = detect(config)
    if is_draft(method) and reads_hidden_states(found):
        raise SpecError(
            f"{key}.method",
            f"{model} is an {found.upper()} head (its config.json says so), not a draft model: "
            f"use method: {found}",
        )
    known = method_named(method)
    if (
        known is not None
        and known.sequential
        and mask_token(config) is None
        and (reads_hidden_states(found) == known.reads_hidden_states)
    ):
        raise SpecError(
            f"{key}.model",
            f"{model} names no mask token in its config.json ({', '.join(known.config_keys)}), which "
            f"a parallel {known.role} reads in the places it predicts: train one with `batchspec "
            f"distill --method {known.name}`, or use method: {known.sequential}",
        )
    mask = mask_token(config)
    if known is not None and known.sequential and mask is not None:
        # the token is read through the drafter's embedding (a head's: the target's)
        own = head_layer_config(config) if reads_hidden_states(found) else text_config(config)
        vocab = own.get("vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and not 0 <= mask < vocab:
            raise SpecError(
                f"{key}.model",
                f"{model}'s config.json names the mask token {mask}, not a token id of its "
                f"vocabulary (0..{vocab - 1})",
            )
    if head and is_draft(found):
        raise SpecError(
            f"{key}.method",
            f"{model} is a draft model (architectures {quoted(config.get('architectures'))}), not "
            f"an {method.upper()} head: use method: draft_model",
        )
    sequential = getattr(method_named(found), "sequential", None)  # a parallel head's also drafts so
    if head and reads_hidden_states(found) and method not in (found, sequential):
        raise SpecError(f"{key}.method", f"{model} is an {found.upper()} head: use method: {found}")
    if not head:
        return
    target_config = load_config(target, "model.target", gguf=True)
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
    if has_lora and reads_hidden_states(method):
        raise SpecError(
            key,
            f"LoRA adapters cannot run beside an {method.upper()} head on vLLM 0.32: the head shares "
            "the target's embedding, which LoRA wraps, and the engine fails on the head's first "
            "draft step; use a draft model (method: draft_model) or ngram with adapters, or run "
            "without them",
        )


def check_head_fits(directory: Path, config: dict, target: dict, method: str, key: str) -> None:
    """The head at ``directory`` (its ``config``) against the target's config. Both configs'
    fields are type-checked here too, for callers that read them leniently (distill's
    ``--head``); the head's faults name ``key``, the target's ``model.target``."""
    problem = config_problem(config)
    if problem is not None:
        raise SpecError(key, f"{directory}: {problem}")
    problem = config_problem(target)
    if problem is not None:
        raise SpecError("model.target", problem)
    head = head_layer_config(config)
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
    tensors = weight_tensors(directory, key)
    d2t = tensors.get("d2t")
    if draft_vocab is not None and t_vocab is not None and draft_vocab != t_vocab:
        if draft_vocab > t_vocab:
            raise SpecError(
                key,
                f"the head's draft_vocab_size ({draft_vocab}) is larger than the target's "
                f"vocabulary ({t_vocab})",
            )
        if d2t is None or d2t.shape != (draft_vocab,):
            raise SpecError(
                key,
                f"the head's draft vocabulary ({draft_vocab} tokens) is smaller than the "
                f"target's ({t_vocab}), and its weights hold no d2t mapping of {draft_vocab} "
                f"entries (found {None if d2t is None else list(d2t.shape)}): vLLM could not map "
                "its tokens to the target's",
            )
        low, high = _d2t_ids(d2t, key)
        if low < 0 or high >= t_vocab:
            raise SpecError(
                key,
                f"the head's d2t mapping sends draft tokens to ids outside the target's "
                f"vocabulary (0..{t_vocab - 1})",
            )
    lm_head = tensors["lm_head.weight"].shape if "lm_head.weight" in tensors else None
    if lm_head and draft_vocab is not None and lm_head[0] != draft_vocab:
        raise SpecError(
            key,
            f"the head's lm_head has {lm_head[0]} rows and its config a draft vocabulary of "
            f"{draft_vocab}: the checkpoint does not match its own config",
        )
    known = method_named(method)
    if known is None or not known.aux_layers or not isinstance(t_layers, int):
        return
    ids = aux_layer_ids(head, t_layers)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < t_layers]
    if bad:
        raise SpecError(
            key,
            f"the head's eagle_aux_hidden_state_layer_ids {quoted(ids)} name layers the target does not "
            f"have: it has {t_layers} (ids 0..{t_layers - 1})"
            + ("" if head.get("eagle_aux_hidden_state_layer_ids") else " (vLLM's default: none set)"),
        )
    fc = tensors["fc.weight"].shape if "fc.weight" in tensors else None
    if fc and t_hidden and len(fc) == 2 and fc[1] != len(ids) * t_hidden:
        raise SpecError(
            key,
            f"the head's fc takes {fc[1]} inputs and {len(ids)} auxiliary layers of the target give "
            f"{len(ids) * t_hidden}: its eagle_aux_hidden_state_layer_ids do not match its weights",
        )
    if known.sequential and t_hidden:
        # a parallel head's mask positions read this in place of the target's hidden states
        mask_hidden = tensors.get(MASK_HIDDEN)
        wanted = len(ids) * t_hidden
        if mask_hidden is None or math.prod(mask_hidden.shape) != wanted:
            raise SpecError(
                key,
                f"a parallel {method.upper()} head needs a {MASK_HIDDEN} tensor of {wanted} values (its "
                f"mask positions' hidden state, {len(ids)} auxiliary layers of {t_hidden}); its weights "
                f"hold {'none' if mask_hidden is None else list(mask_hidden.shape)}: train one with "
                f"`batchspec distill --method {method}`, or use method: {known.sequential}",
            )
