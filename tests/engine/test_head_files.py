"""A head's files as an attacker would write them: its config.json and its weight files' headers
mistyped, nested deep, huge or torn, and its path a symlink to a file or a loop. Each is refused
with exit 2 naming the caller's key (``speculative.model``, ``--draft``, ``speculative.drafts[i]``,
``--head``) before any engine, never with a traceback or exit 1. The heads and the target here
are small synthetic files (a config.json and a hand-written safetensors file), so no test needs
the built models, vLLM or torch, but the CLI's, which imports vLLM to check keys."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.jobs import run_cli_in_process, write_parquet

from batchspec.errors import SpecError
from batchspec.spec.build import build_spec

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "vocab_size": 128,
    "num_hidden_layers": 4,
}
DRAFT_VOCAB = 32
HEAD = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "draft_vocab_size": DRAFT_VOCAB,
    "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    "transformer_layer_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "vocab_size": 128,
        "num_hidden_layers": 1,
    },
}


def _tensors(d2t: tuple[str, list, bytes] | None = None) -> dict[str, tuple[str, list, bytes]]:
    """fc for three target layers of 64, a 32-token draft vocabulary and its mapping (draft id i
    to target id i)."""
    return {
        "fc.weight": ("F32", [64, 192], bytes(64 * 192 * 4)),
        "lm_head.weight": ("F32", [DRAFT_VOCAB, 64], bytes(DRAFT_VOCAB * 64 * 4)),
        "d2t": d2t or ("I64", [DRAFT_VOCAB], bytes(DRAFT_VOCAB * 8)),
    }


def _safetensors(path: Path, tensors: dict, header: bytes | None = None, cut: int = 0) -> Path:
    """A safetensors file as the format defines it: a little-endian u64 header length, the JSON
    header, the tensors' bytes. ``header`` replaces the JSON; ``cut`` drops the file's last bytes."""
    entries, data = {}, b""
    for name, (dtype, shape, blob) in tensors.items():
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    raw = json.dumps(entries).encode() if header is None else header
    body = struct.pack("<Q", len(raw)) + raw + data
    path.write_bytes(body[: len(body) - cut])
    return path


def _dir(path: Path, config: dict, tensors: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        _safetensors(path / "model.safetensors", tensors)
    return path


@pytest.fixture
def target(tmp_path) -> Path:
    return _dir(tmp_path / "target", TARGET)


@pytest.fixture
def head(tmp_path) -> Path:
    return _dir(tmp_path / "head", json.loads(json.dumps(HEAD)), _tensors())


def _raw(tmp_path: Path, target: Path, speculative) -> dict:
    return {
        "name": "head-files",
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": str(target)},
        "speculative": speculative,
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }


# ---------------------------------------------------------------- the callers, each with its key


def _explicit(tmp_path, target, model):
    """``validate`` and ``run`` with ``speculative: {method: eagle3, model: ...}``."""
    from batchspec.engine.heads import check_speculative_model

    spec = build_spec(
        _raw(tmp_path, target, {"method": "eagle3", "model": model, "num_speculative_tokens": 3})
    )
    check_speculative_model(spec.model.target, spec.speculative)
    return "speculative.model"


def _shorthand(tmp_path, target, model):
    """The shorthand: no method, the checkpoint's config says which (build_spec reads it)."""
    from batchspec.engine.heads import check_speculative_model

    spec = build_spec(_raw(tmp_path, target, {"model": model, "num_speculative_tokens": 3}))
    check_speculative_model(spec.model.target, spec.speculative)
    return "speculative.model"


def _tune(tmp_path, target, model):
    from batchspec.tune.session import check_candidate_models

    check_candidate_models(build_spec(_raw(tmp_path, target, None)), [model], "--draft")
    return "--draft"


def _auto(tmp_path, target, model):
    from batchspec.tune.auto import check_auto

    check_auto(build_spec(_raw(tmp_path, target, {"method": "auto", "drafts": [model], "k": [2]})))
    return "speculative.drafts[0]"


def _distill(tmp_path, target, model):
    from batchspec.distill.options import DistillOptions
    from batchspec.distill.session import check_options

    spec = build_spec(_raw(tmp_path, target, None))
    check_options(spec, DistillOptions(out=tmp_path / "distilled", method="eagle3", head=model))
    return "--head"


CALLERS = [_explicit, _shorthand, _tune, _auto, _distill]


def _refused(caller: Callable, tmp_path: Path, target: Path, model: Path | str) -> SpecError:
    """The caller's SpecError naming its key; anything else (another exception, none) fails."""
    key = {
        _explicit: "speculative.model",
        _shorthand: "speculative.model",
        _tune: "--draft",
        _auto: "speculative.drafts[0]",
        _distill: "--head",
    }[caller]
    with pytest.raises(SpecError) as err:
        caller(tmp_path, target, str(model))
    assert err.value.key == key, str(err.value)
    return err.value


# ---------------------------------------------------------------- the head's config.json


def _config(head: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((head / "config.json").read_text())
    change(config)
    (head / "config.json").write_text(json.dumps(config))


def _layer(**fields) -> Callable[[dict], None]:
    return lambda c: c["transformer_layer_config"].update(fields)


def _top(**fields) -> Callable[[dict], None]:
    return lambda c: c.update(fields)


def _vllm_format(**fields) -> Callable[[dict], None]:
    """vLLM's own head format: no speculators_model_type, the architecture says what it is."""

    def change(config: dict) -> None:
        config.pop("speculators_model_type")
        config.update(fields)

    return change


def _text(text: str | bytes) -> Callable[[Path], None]:
    def write(head: Path) -> None:
        path = head / "config.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return write


def _fifo(head: Path) -> None:
    (head / "config.json").unlink()
    os.mkfifo(head / "config.json")


def _config_loop(head: Path) -> None:
    (head / "config.json").unlink()
    (head / "config.json").symlink_to(head / "config.json")


def _config_dir(head: Path) -> None:
    (head / "config.json").unlink()
    (head / "config.json").mkdir()


DEEP = 100_000
CONFIG_CASES = {
    "architectures an int": (_top(architectures=5), "architectures is 5, not a list of names"),
    "architectures an int in vLLM's format": (_vllm_format(architectures=5), "architectures is 5"),
    "architectures a dict in vLLM's format": (_vllm_format(architectures={}), "architectures is {}"),
    "architectures with an int": (_top(architectures=["Eagle3Speculator", 3]), "not a list of names"),
    "architectures a string": (_top(architectures="Eagle3Speculator"), "not a list of names"),
    "speculators_model_type a list": (_top(speculators_model_type=["eagle3"]), "not a string"),
    "model_type an object": (_top(model_type={"eagle": 1}), "model_type is {'eagle': 1}, not a string"),
    "transformer_layer_config a string": (
        _top(transformer_layer_config="x"),
        "transformer_layer_config is 'x', not an object",
    ),
    "text_config a list": (_top(text_config=[1]), "text_config is [1], not an object"),
    "eagle_config a list": (_top(eagle_config=[1]), "eagle_config is [1], not an object"),
    "hidden_size a string": (_layer(hidden_size="64"), "hidden_size is '64', not a positive whole number"),
    "hidden_size huge": (_layer(hidden_size=2**64), "hidden_size is 18446744073709551616, not a positive"),
    "hidden_size null in a list": (_layer(hidden_size=[None]), "hidden_size is [None], not a positive"),
    "vocab_size a float": (_layer(vocab_size=128.0), "vocab_size is 128.0, not a positive whole number"),
    "num_hidden_layers negative": (_layer(num_hidden_layers=-1), "num_hidden_layers is -1"),
    "draft_vocab_size NaN": (_top(draft_vocab_size=float("nan")), "draft_vocab_size is nan"),
    "draft_vocab_size a bool": (_top(draft_vocab_size=False), "draft_vocab_size is False"),
    "target_hidden_size huge": (_top(target_hidden_size=10**40), "target_hidden_size is 1000000000"),
    "aux layer ids an object": (
        _top(eagle_aux_hidden_state_layer_ids={"a": 1}),
        "not a list of layer ids",
    ),
    "aux layer ids huge": (
        _top(eagle_aux_hidden_state_layer_ids=[1, 2, 10**30]),
        "name layers the target does not have",
    ),
    "aux layer ids nested": (
        _top(eagle_aux_hidden_state_layer_ids=[[[[[[[[1]]]]]]]]),
        "name layers the target does not have",
    ),
}
CONFIG_FILES = {
    "digits past Python's limit": (_text('{"hidden_size": 1' + "0" * 5000 + "}"), "cannot be read as JSON"),
    "nested 100k deep": (_text('{"a": ' + "[" * DEEP + "]" * DEEP + "}"), "nested too deep"),
    "objects nested 100k deep": (_text('{"a": ' * DEEP + "1" + "}" * DEEP), "nested too deep"),
    "a JSON null": (_text("null"), "holds a JSON null, not an object"),
    "a JSON string": (_text('"eagle3"'), "holds a JSON string, not an object"),
    "a JSON number": (_text("7"), "holds a JSON number, not an object"),
    "not UTF-8": (_text(b'{"model_type": "\xff"}'), "cannot be read as JSON"),
    "over the cap": (_text("{" + " " * (5 * 2**20) + "}"), "over the 4 MiB a config.json may hold"),
    "a FIFO": (_fifo, "config.json is not a regular file"),
    "a symlink loop": (_config_loop, "config.json is not a regular file"),
    "a directory": (_config_dir, "config.json is not a regular file"),
}


def _bounded(call: Callable[[], None], seconds: float = 60) -> None:
    """Run ``call`` in a thread: a check that opens a FIFO and waits for a writer fails here
    instead of hanging the test run."""
    outcome: list = []

    def target():
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s (blocked on a FIFO?)"
    if outcome[0] is not None:
        raise outcome[0]


@pytest.mark.parametrize("caller", CALLERS)
def test_the_synthetic_head_fits_its_target(tmp_path, target, head, caller):
    """The starting point of every refusal below is accepted by every caller."""
    caller(tmp_path, target, str(head))


@pytest.mark.parametrize("case", CONFIG_CASES)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_config_field_of_the_wrong_type_is_refused_naming_the_key(tmp_path, target, head, caller, case):
    change, words = CONFIG_CASES[case]
    _config(head, change)
    err = _refused(caller, tmp_path, target, head)
    # distill reads the config itself before it checks the fields: its refusal names --head
    if caller is not _distill or case.startswith(("hidden", "vocab", "num", "draft", "target", "aux")):
        assert words in str(err), str(err)


@pytest.mark.parametrize("case", CONFIG_FILES)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_config_json_that_is_no_config_is_refused_naming_the_key(tmp_path, target, head, caller, case):
    write, words = CONFIG_FILES[case]
    write(head)
    err: list[SpecError] = []
    _bounded(lambda: err.append(_refused(caller, tmp_path, target, head)))
    if caller is not _distill:
        assert words in str(err[0]), str(err[0])


def test_a_config_json_is_read_no_further_than_its_cap(tmp_path, target, head):
    """A huge config.json is refused from its first bytes past the cap, never read whole."""
    import tracemalloc

    from batchspec.engine.heads import check_speculative_model

    (head / "config.json").write_bytes(b"{" + b" " * (64 * 2**20) + b"}")
    tracemalloc.start()
    try:
        with pytest.raises(SpecError, match="over the 4 MiB"):
            check_speculative_model(str(target), {"method": "eagle3", "model": str(head)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB"


# ---------------------------------------------------------------- the head's path


def _path_to_file(tmp_path: Path, head: Path) -> Path:
    link = tmp_path / "head-link"
    link.symlink_to(head / "config.json")
    return link


def _path_loop(tmp_path: Path, head: Path) -> Path:
    link = tmp_path / "head-loop"
    link.symlink_to(tmp_path / "head-loop-2")
    (tmp_path / "head-loop-2").symlink_to(link)
    return link


def _path_dangling(tmp_path: Path, head: Path) -> Path:
    link = tmp_path / "head-dangling"
    link.symlink_to(tmp_path / "nothing-here")
    return link


def _path_file(tmp_path: Path, head: Path) -> Path:
    return head / "model.safetensors"


PATH_CASES = {
    "a symlink to a file": (_path_to_file, "not a model directory"),
    "a symlink loop": (_path_loop, "cannot be read"),
    "a dangling symlink": (_path_dangling, "cannot be read"),
    "a plain file": (_path_file, "not a model directory"),
}


@pytest.mark.parametrize("case", PATH_CASES)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_head_path_that_is_no_directory_is_refused_naming_the_key(tmp_path, target, head, caller, case):
    make, words = PATH_CASES[case]
    err = _refused(caller, tmp_path, target, make(tmp_path, head))
    if caller not in (_distill, _auto):  # each says it in its own words
        assert words in str(err), str(err)


def test_a_symlink_to_a_head_directory_is_a_head(tmp_path, target, head):
    link = tmp_path / "head-link"
    link.symlink_to(head, target_is_directory=True)
    for caller in CALLERS:
        caller(tmp_path, target, str(link))


def test_a_gguf_draft_file_is_left_to_vllm_but_a_gguf_head_is_refused(tmp_path, target):
    from batchspec.engine.heads import check_speculative_model

    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    check_speculative_model(str(target), {"method": "draft_model", "model": str(gguf)})
    with pytest.raises(SpecError) as err:
        check_speculative_model(str(target), {"method": "eagle3", "model": str(gguf)})
    assert err.value.key == "speculative.model" and "not a model directory" in str(err.value)


# ---------------------------------------------------------------- the head's weight files


def _weights(
    tensors: dict | None = None, header: bytes | None = None, cut: int = 0
) -> Callable[[Path], None]:
    return lambda head: _safetensors(head / "model.safetensors", tensors or _tensors(), header, cut)


def _entries(changes: dict | None = None) -> bytes:
    """The synthetic head's header with entries changed (a mapping: its fields updated)."""
    entries, offset = {}, 0
    for name, (dtype, shape, blob) in _tensors().items():
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    for name, value in (changes or {}).items():
        if value is None:
            del entries[name]
        elif isinstance(value, dict) and name in entries:
            entries[name].update(value)
        else:
            entries[name] = value
    return json.dumps(entries).encode()


def _d2t(dtype: str, values: list) -> dict:
    fmt = {"I64": "q", "I32": "i", "F32": "f", "BOOL": "?", "U8": "B"}[dtype]
    return _tensors(d2t=(dtype, [len(values)], struct.pack(f"<{len(values)}{fmt}", *values)))


def _trailing(head: Path) -> None:
    with open(_safetensors(head / "model.safetensors", _tensors()), "ab") as f:
        f.write(bytes(8))


def _fifo_weights(head: Path) -> None:
    (head / "model.safetensors").unlink()
    os.mkfifo(head / "model.safetensors")


def _loop_weights(head: Path) -> None:
    (head / "model.safetensors").unlink()
    (head / "model.safetensors").symlink_to(head / "model.safetensors")


NAN = float("nan")
WEIGHT_CASES = {
    "header nested 100k deep": (_weights(header=b"[" * DEEP + b"]" * DEEP), "nested too deep"),
    "header objects nested 100k deep": (
        _weights(header=b'{"a":' * DEEP + b"1" + b"}" * DEEP),
        "nested too deep",
    ),
    "header a list": (_weights(header=b"[]"), "its header is not a JSON object"),
    "header not UTF-8": (_weights(header=b'{"\xff": 1}'), "not a readable safetensors file"),
    "header length torn": (lambda h: (h / "model.safetensors").write_bytes(b"\x10\0\0"), "torn"),
    "header torn": (_weights(header=b"{}", cut=10**6), "torn"),
    "header length huge": (
        lambda h: (h / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}"),
        "a header of 1099511627776 bytes",
    ),
    "an entry an int": (_weights(header=_entries({"fc.weight": 5})), "fc.weight is 5, not an object"),
    "a shape an int": (
        _weights(header=_entries({"fc.weight": {"shape": 5}})),
        "fc.weight's shape is 5, not a list of sizes",
    ),
    "a shape of strings": (
        _weights(header=_entries({"lm_head.weight": {"shape": ["32", 64]}})),
        "lm_head.weight's shape is ['32', 64]",
    ),
    "a shape of bools": (_weights(header=_entries({"d2t": {"shape": [True]}})), "d2t's shape is [True]"),
    "a shape negative": (_weights(header=_entries({"d2t": {"shape": [-32]}})), "d2t's shape is [-32]"),
    "a shape nested": (_weights(header=_entries({"d2t": {"shape": [[32]]}})), "d2t's shape is [[32]]"),
    "a dtype a list": (_weights(header=_entries({"d2t": {"dtype": ["I64"]}})), "d2t's dtype is ['I64']"),
    "offsets missing": (_weights(header=_entries({"d2t": {"data_offsets": None}})), "d2t's data_offsets"),
    "offsets backwards": (
        _weights(header=_entries({"d2t": {"data_offsets": [8, 0]}})),
        "d2t's data_offsets are [8, 0]",
    ),
    "offsets past the end": (
        _weights(header=_entries({"d2t": {"data_offsets": [0, 10**9]}})),
        "runs past the end of the file (torn?)",
    ),
    "a size that does not match the shape": (
        _weights(header=_entries({"fc.weight": {"shape": [64, 193]}})),
        "fc.weight's data_offsets hold 49152 bytes and its shape and dtype make 49408",
    ),
    "offsets overlapping": (
        _weights(header=_entries({"lm_head.weight": {"data_offsets": [0, DRAFT_VOCAB * 64 * 4]}})),
        "its tensors' data do not follow each other",
    ),
    "bytes after the last tensor": (_trailing, "its tensors take 57600 bytes and 57608 follow its header"),
    "metadata of numbers": (
        _weights(header=_entries({"__metadata__": {"format": 1}})),
        "__metadata__ is {'format': 1}, not an object of strings",
    ),
    "d2t as NaN": (_weights(_d2t("F32", [NAN] * DRAFT_VOCAB)), "d2t holds F32 values, not token ids"),
    "d2t as floats": (_weights(_d2t("F32", [0.0] * DRAFT_VOCAB)), "d2t holds F32 values"),
    "d2t as bools": (_weights(_d2t("BOOL", [False] * DRAFT_VOCAB)), "d2t holds BOOL values"),
    "d2t data torn after a valid header": (_weights(cut=8), "d2t's data runs past the end of the file"),
    "d2t data torn to its header": (_weights(cut=DRAFT_VOCAB * 8), "runs past the end of the file"),
    "d2t out of the target's vocabulary": (
        _weights(_d2t("I64", [0] * (DRAFT_VOCAB - 1) + [200])),
        "outside the target's vocabulary (0..127)",
    ),
    "d2t negative": (_weights(_d2t("I32", [-1] + [0] * (DRAFT_VOCAB - 1))), "outside the target's"),
    "d2t huge": (
        _weights(_d2t("I64", [2**63 - 1] + [0] * (DRAFT_VOCAB - 1))),
        "outside the target's vocabulary",
    ),
    "a weight file a FIFO": (_fifo_weights, "not a regular file"),
    "a weight file a symlink loop": (_loop_weights, "not a readable safetensors file"),
}


@pytest.mark.parametrize("case", WEIGHT_CASES)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_weight_file_that_is_torn_or_mistyped_is_refused_naming_the_key(
    tmp_path, target, head, caller, case
):
    write, words = WEIGHT_CASES[case]
    write(head)
    err: list[SpecError] = []
    _bounded(lambda: err.append(_refused(caller, tmp_path, target, head)))
    assert words in str(err[0]), str(err[0])


@pytest.mark.parametrize(
    "d2t",
    [
        ("I32", list(range(0, 96, 3))),  # draft id i -> target id 4i: every one the target's
        ("U8", [96] * DRAFT_VOCAB),  # the last: 31 + 96 = 127
        ("I64", [0] * DRAFT_VOCAB),
    ],
)
def test_a_d2t_of_any_integer_type_within_the_target_is_accepted(tmp_path, target, head, d2t):
    _weights(_d2t(*d2t))(head)
    for caller in CALLERS:
        caller(tmp_path, target, str(head))


def test_the_synthetic_weight_file_is_one_safetensors_reads(tmp_path, head):
    """The hand-written format above is the library's own (where it is installed)."""
    safetensors = pytest.importorskip("safetensors")
    pytest.importorskip("numpy")
    with safetensors.safe_open(str(head / "model.safetensors"), "numpy") as f:
        assert f.get_tensor("d2t").shape == (DRAFT_VOCAB,)
        assert f.get_tensor("fc.weight").shape == (64, 192)


def _padded_header(size: int) -> bytes:
    """A valid header of ``size`` bytes: the head's entries and a metadata string as padding."""
    base = json.loads(_entries())
    base["__metadata__"] = {"pad": ""}
    pad = size - len(json.dumps(base).encode())
    base["__metadata__"]["pad"] = "x" * pad
    raw = json.dumps(base).encode()
    assert len(raw) == size
    return raw


def test_the_header_bytes_of_all_weight_files_together_are_capped(tmp_path, target, head):
    """Three header-only files under the per-file cap each are refused once their sum passes it,
    before the last header is read."""
    from batchspec.engine.heads import MAX_HEADER_BYTES

    third = MAX_HEADER_BYTES // 3 + 1
    (head / "model.safetensors").unlink()
    for i in range(3):
        _safetensors(head / f"model-0000{i}-of-00003.safetensors", _tensors(), header=_padded_header(third))
    for caller in CALLERS:
        err = _refused(caller, tmp_path, target, head)
        assert f"over the {MAX_HEADER_BYTES // 2**20} MiB" in str(err), str(err)


def test_weight_headers_are_not_held_all_at_once(tmp_path, target, head):
    """Each file's header is read, the few tensors the checks need kept, and dropped before the
    next file's: the peak is about one parsed header, not three."""
    import tracemalloc

    from batchspec.engine.heads import check_speculative_model

    (head / "model.safetensors").unlink()
    raws = []
    for i in range(3):
        header = json.loads(_entries()) if i == 0 else {}
        for j in range(10_000):  # small entries: parsed, each is several times its bytes
            header[f"{i}.pad.{j}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
        raw = json.dumps(header).encode()
        data = b"".join(blob for _, _, blob in _tensors().values()) if i == 0 else b""
        (head / f"model-0000{i}-of-00003.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        raws.append(raw)
    tracemalloc.start()
    try:
        json.loads(raws[1])
        _, one = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        check_speculative_model(str(target), {"method": "eagle3", "model": str(head)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * one, f"peak {peak / 2**20:.1f} MiB, one header parsed {one / 2**20:.1f} MiB"


# ---------------------------------------------------------------- through the CLI


def _bad_config(tmp_path: Path, head: Path) -> Path:
    _config(head, _vllm_format(architectures=5))
    return head


def _torn_d2t(tmp_path: Path, head: Path) -> Path:
    _weights(cut=8)(head)
    return head


@pytest.mark.vllm
@pytest.mark.parametrize(
    "bend, words",
    [
        (_bad_config, "architectures is 5"),
        (_torn_d2t, "d2t's data runs past the end"),
        (_path_to_file, "not a model directory"),
    ],
)
def test_validate_exits_2_naming_the_key_on_the_shorthand_form(tmp_path, target, head, bend, words):
    """``speculative: {model: X}`` (the method read from X's config) with a bad head: exit 2
    naming ``speculative.model`` from ``batchspec validate``, before any engine (the target here
    has a config.json and no weights, so none could start)."""
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["def f():"]})
    model = bend(tmp_path, head)
    raw = _raw(tmp_path, target, {"model": str(model), "num_speculative_tokens": 3})
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(raw))
    result = run_cli_in_process("validate", str(job))
    assert result.returncode == 2, result.stderr
    assert "speculative.model" in result.stderr and words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
