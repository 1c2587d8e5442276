"""The output fingerprint: which parts of a spec shape the output, hashed per component, and
which changed between two runs; a local model by its bytes, with the digests cached per user."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import shutil
import stat
import threading

import pytest
from helpers.fake_runs import run, shards
from helpers.jobs import run_cli_in_process, write_job

from batchspec.errors import SpecError
from batchspec.run.stages import plan
from batchspec.spec import fingerprint as fingerprint_mod
from batchspec.spec.build import build_spec
from batchspec.spec.fingerprint import (
    COMPONENTS,
    FINGERPRINT_VERSION,
    DigestCache,
    describe_changes,
    model_identity,
    spec_fingerprint,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test here keeps its digests in its own cache directory (never the user's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "batchspec"


def make_model(path, hidden=64, weights=b"\0" * 1000, tokenizer='{"vocab": {"a": 0}}'):
    """A directory shaped like a Hugging Face model (nothing loads it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden, "vocab_size": 256}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text(tokenizer)
    (path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return path


def raw_spec(tmp_path, **changes):
    raw = {
        "name": "fp",
        "input": {"path": "in/*.parquet", "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": "out/", "keep_columns": ["id"]},
        "model": {
            "target": str(tmp_path / "target"),
            "engine": {"max_model_len": 512, "dtype": "float32", "enforce_eager": True},
        },
        "speculative": {
            "method": "draft_model",
            "model": str(tmp_path / "draft"),
            "num_speculative_tokens": 4,
        },
        "sampling": {"temperature": 0.0, "max_tokens": 32},
    }
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        if value is _DELETE:
            node.pop(last)
        else:
            node[last] = value
    return raw


_DELETE = object()


@pytest.fixture
def models(tmp_path):
    make_model(tmp_path / "target")
    make_model(tmp_path / "draft", hidden=32, weights=b"\0" * 500)
    return tmp_path


def fp(tmp_path, **changes):
    return spec_fingerprint(build_spec(raw_spec(tmp_path, **changes)))


def test_components_are_short_hex_and_stable(models):
    first = fp(models)
    assert list(first) == [c for c in COMPONENTS if c != "model.lora"]  # no adapters here
    assert all(re.fullmatch(r"[0-9a-f]{16}", v) for v in first.values())
    assert fp(models) == first
    assert FINGERPRINT_VERSION == 2


@pytest.mark.parametrize(
    "changes, changed",
    [
        ({"sampling__max_tokens": 64}, ["sampling"]),
        ({"sampling__temperature": 0.7}, ["sampling"]),
        ({"speculative__num_speculative_tokens": 2}, ["speculative"]),
        ({"speculative": None}, ["speculative.model", "speculative"]),
        (
            {"speculative": {"method": "ngram", "num_speculative_tokens": 4}},
            ["speculative.model", "speculative"],
        ),
        ({"model__engine__dtype": "bfloat16"}, ["model.engine"]),
        ({"model__engine__max_model_len": 1024}, ["model.engine"]),
        ({"model__engine__kv_cache_dtype": "fp8"}, ["model.engine"]),
        ({"model__engine__seed": 7}, ["model.engine"]),
        ({"model__engine__hf_overrides": {"rope_theta": 1e6}}, ["model.engine"]),
        ({"model__engine__some_future_vllm_arg": 3}, ["model.engine"]),  # unknown: counts
        ({"input__prompt_column": _DELETE, "input__messages_column": "messages"}, ["columns"]),
        ({"input__id_column": "uid"}, ["columns"]),
        ({"input__sampling_columns": {"max_tokens": "mt"}}, ["columns"]),
        ({"output__keep_columns": ["id", "topic"]}, ["columns"]),
        ({"output__keep_columns": _DELETE}, ["columns"]),  # all columns differs from [id]
    ],
)
def test_what_changes_the_output_is_seen(models, changes, changed):
    assert describe_changes(fp(models), fp(models, **changes)) == changed


def make_adapter(path, weights=b"\1" * 300, r=8):
    """A directory shaped like a PEFT LoRA adapter (nothing loads it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 16}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_lora_adapters_are_part_of_the_fingerprint_by_their_contents(models, no_racy_window):
    """An adapter is the output's lineage: its weights and config count, its place does not,
    and a job without adapters keeps the hashes it had before LoRA existed."""
    make_adapter(models / "a")
    make_adapter(models / "b", weights=b"\2" * 300)
    lora = {"adapters": {"a": str(models / "a"), "b": str(models / "b")}}
    base = fp(models)
    with_lora = fp(models, model__lora=lora)
    assert describe_changes(base, with_lora) == ["model.lora"]
    assert {k: v for k, v in with_lora.items() if k != "model.lora"} == base
    shutil.copytree(models / "a", models / "a-copy")
    moved = {"adapters": {"a": str(models / "a-copy"), "b": str(models / "b")}}
    assert fp(models, model__lora=moved) == with_lora
    (models / "b" / "adapter_model.safetensors").write_bytes(b"\3" * 300)  # retrained in place
    assert describe_changes(with_lora, fp(models, model__lora=lora)) == ["model.lora"]
    cfg = models / "a" / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 32}))
    assert describe_changes(with_lora, fp(models, model__lora=lora)) == ["model.lora"]
    job_wide = fp(models, model__lora={**lora, "adapter": "a"})
    assert describe_changes(fp(models, model__lora=lora), job_wide) == ["model.lora"]
    per_row = fp(models, model__lora=lora, input__lora_column="adapter")
    assert describe_changes(fp(models, model__lora=lora), per_row) == ["columns"]
    assert fp(models, model__lora={**lora, "max_loras": 1}) == fp(models, model__lora=lora)


@pytest.mark.parametrize(
    "changes",
    [
        {"model__engine__max_num_seqs": 8},
        {"model__engine__gpu_memory_utilization": 0.5},
        {"model__engine__enforce_eager": False},
        {"model__engine__tensor_parallel_size": 2},
        {"model__engine__enable_prefix_caching": True},
        {"model__engine__max_num_batched_tokens": 4096},
        {"model__engine__disable_log_stats": False},
        {"model__engine__hf_token": "hf_secret_one"},
        {"input__storage_options": {"key": "AKIA", "secret": "s3cr3t"}},
        {"output__storage_options": {"token": "t0k3n"}},
        {"input__path": "s3://bucket/other/*.parquet"},
        {"output__path": "s3://bucket/elsewhere/"},
        {"output__row_group_rows": 7, "output__compression": "snappy"},
        {"execution": {"max_in_flight": 3, "grace_s": 1, "lease_s": 10}},
        {"name": "renamed"},
    ],
)
def test_throughput_knobs_secrets_and_places_do_not_count(models, changes):
    assert describe_changes(fp(models), fp(models, **changes)) == []


def test_local_model_identity_is_its_contents(models, tmp_path):
    base = fp(models)
    # the same model copied elsewhere is the same model
    shutil.copytree(models / "target", tmp_path / "copy")
    assert fp(models, model__target=str(tmp_path / "copy")) == base
    # re-indenting config.json is not a new model
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config, indent=4))
    assert fp(models, model__target=str(tmp_path / "copy")) == base
    for change in (
        lambda d: (d / "config.json").write_text(json.dumps({**config, "hidden_size": 65})),
        lambda d: (d / "model.safetensors").write_bytes(b"\0" * 1001),
        lambda d: (d / "model-00002-of-00002.safetensors").write_bytes(b"\0"),
        lambda d: (d / "tokenizer.json").write_text('{"vocab": {"b": 0}}'),
        lambda d: (d / "tokenizer_config.json").write_text('{"chat_template": "other"}'),
        lambda d: (d / "generation_config.json").write_text('{"temperature": 0.6}'),
    ):
        changed = tmp_path / "changed"
        shutil.rmtree(changed, ignore_errors=True)
        shutil.copytree(models / "target", changed)
        change(changed)
        assert describe_changes(base, fp(models, model__target=str(changed))) == ["model.target"]


def test_draft_identity_and_absence(models, tmp_path):
    make_model(tmp_path / "draft2", hidden=48)
    assert describe_changes(fp(models), fp(models, speculative__model=str(tmp_path / "draft2"))) == [
        "speculative.model"
    ]
    without = fp(models, speculative=None)
    assert "speculative.model" not in without
    ngram = fp(models, speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert "speculative.model" not in ngram


def test_hub_model_identity_is_id_and_revisions(models):
    hub = fp(models, model__target="org/some-model")
    assert describe_changes(hub, fp(models, model__target="org/other-model")) == ["model.target"]
    changed = describe_changes(
        hub, fp(models, model__target="org/some-model", model__engine__revision="abc123")
    )
    assert changed == ["model.target", "model.engine"]
    changed = describe_changes(
        hub, fp(models, model__target="org/some-model", model__engine__tokenizer_revision="v2")
    )
    assert changed == ["model.target", "model.engine"]
    draft_rev = fp(
        models,
        model__target="org/some-model",
        speculative={"model": "org/draft", "num_speculative_tokens": 4},
    )
    draft_rev2 = fp(
        models,
        model__target="org/some-model",
        speculative={"model": "org/draft", "num_speculative_tokens": 4, "revision": "r2"},
    )
    assert describe_changes(draft_rev, draft_rev2) == ["speculative.model", "speculative"]


def test_a_new_url_signature_is_the_same_model(models):
    one = fp(models, model__target="https://u:pw@models.example/m?X-Amz-Signature=aaaa")
    two = fp(models, model__target="https://v:pw2@models.example/m?X-Amz-Signature=bbbb")
    assert one == two


def test_describe_changes_order_and_missing_components():
    old = {"model.target": "1", "sampling": "2", "columns": "3", "zeta": "9"}
    new = {"columns": "4", "model.target": "1", "speculative.model": "5", "alpha": "0", "sampling": "2"}
    assert describe_changes(old, new) == ["speculative.model", "columns", "alpha", "zeta"]
    assert describe_changes(new, old) == ["speculative.model", "columns", "alpha", "zeta"]
    assert describe_changes({}, {}) == []


# ------------------------------------------------------------- a model is its bytes


def rewrite_same_size(file, keep_mtime=False):
    """Change a file's bytes in place, keeping its size (and, if asked, its mtime): a draft
    retrained in place, or a copy tool that restores timestamps."""
    before = os.stat(file)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(file, "r+b") as handle:  # in place: same inode
        handle.write(data)
    if keep_mtime:
        os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(file)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert not keep_mtime or after.st_mtime_ns == before.st_mtime_ns


@pytest.fixture
def no_racy_window(monkeypatch):
    """Files written a moment ago are cacheable (the tests write them and hash at once)."""
    monkeypatch.setattr(fingerprint_mod, "RACY_NS", 0)


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_weights_rewritten_with_the_same_size_are_a_new_model(models, no_racy_window, keep_mtime):
    base = fp(models)  # cached now: the rewrite must get past the cache too
    rewrite_same_size(models / "draft" / "model.safetensors", keep_mtime)
    assert describe_changes(base, fp(models)) == ["speculative.model"]
    again = fp(models)
    rewrite_same_size(models / "target" / "model.safetensors", keep_mtime)
    assert describe_changes(again, fp(models)) == ["model.target"]
    # a single model file (a GGUF) too
    gguf = models / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    one = model_identity(str(gguf))
    rewrite_same_size(gguf, keep_mtime)
    assert model_identity(str(gguf)) != one


@pytest.mark.parametrize(
    "name",
    ["params.json", "model.safetensors.index.json", "preprocessor_config.json", "tekken.json", "model.pt"],
)
def test_other_files_vllm_reads_are_content_too(models, name):
    (models / "target" / name).write_text("{}")
    base = fp(models)
    (models / "target" / name).write_text("[]")
    assert describe_changes(base, fp(models)) == ["model.target"]


def test_custom_code_counts_when_a_config_names_it(models):
    (models / "target" / "train.py").write_text("print(1)")
    base = fp(models)
    (models / "target" / "train.py").write_text("print(2)")  # no auto_map: not loaded
    assert fp(models) == base
    config = json.loads((models / "target" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (models / "target" / "config.json").write_text(json.dumps(config))
    (models / "target" / "modeling_x.py").write_text("A = 1")
    custom = fp(models)
    (models / "target" / "modeling_x.py").write_text("A = 2")
    assert describe_changes(custom, fp(models)) == ["model.target"]
    # optimizer state in a checkpoint folder is not the model vLLM loads
    (models / "target" / "checkpoint-5").mkdir()
    (models / "target" / "checkpoint-5" / "optimizer.pt").write_bytes(b"1")
    assert describe_changes(custom, fp(models)) == ["model.target"]  # only modeling_x.py


def test_status_and_rerun_name_a_model_retrained_in_place(tmp_path, models, no_racy_window):
    """The reported case: a run, the draft's safetensors rewritten (same size), a rerun. The
    rerun exits 2 naming ``speculative.model``, ``status`` shows every shard stale with it, and
    the target the same way."""
    shards(tmp_path, n=2, rows=3)
    sections = {
        "input": {"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": str(models / "target")},
        "speculative": {"method": "draft_model", "model": str(models / "draft"), "num_speculative_tokens": 2},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
    }
    spec = build_spec({"name": "retrained", **sections})
    run(spec)
    assert plan(spec).states == {"s0": "committed", "s1": "committed"}
    rewrite_same_size(models / "draft" / "model.safetensors")

    p = plan(spec)
    assert p.stale == {"s0": ["speculative.model"], "s1": ["speculative.model"]}
    with pytest.raises(SpecError) as err:
        run(spec)
    assert err.value.exit_code == 2 and "speculative.model" in str(err.value)
    job = write_job(tmp_path / "job.yaml", **sections)
    result = run_cli_in_process("status", str(job), "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = {r["shard"]: r for r in json.loads(result.stdout)}
    assert {k: (r["state"], r["changed"]) for k, r in rows.items()} == {
        "s0": ("stale", ["speculative.model"]),
        "s1": ("stale", ["speculative.model"]),
    }

    run(spec, overwrite=True)  # the new draft's lineage, then the target retrained
    assert plan(spec).states == {"s0": "committed", "s1": "committed"}
    rewrite_same_size(models / "target" / "model.safetensors", keep_mtime=True)
    assert plan(spec).stale == {"s0": ["model.target"], "s1": ["model.target"]}


# ------------------------------------------------------------- the digest cache


@pytest.fixture
def counted_opens(monkeypatch):
    """Real path -> how many times batchspec opened it to read."""
    counts: dict[str, int] = {}
    real_open = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            key = os.path.realpath(file)
            counts[key] = counts.get(key, 0) + 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    return counts


def test_a_cached_digest_is_not_read_again(models, no_racy_window, counted_opens, private_cache):
    weights = os.path.realpath(models / "target" / "model.safetensors")
    base = fp(models)
    assert counted_opens[weights] == 1
    assert stat.S_IMODE(os.stat(private_cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(private_cache / "digests.json").st_mode) == 0o600
    assert [p.name for p in private_cache.iterdir()] == ["digests.json"]  # no temp left over
    for _ in range(3):  # later runs (a new cache object each, as a new process)
        assert fp(models) == base
    assert counted_opens[weights] == 1
    # a link to the file, or a copy of the directory through a symlink: the same real file
    (models / "link").symlink_to(models / "target")
    assert fp(models, model__target=str(models / "link")) == base
    assert counted_opens[weights] == 1
    # touch: same bytes, new mtime: read again, same model
    os.utime(weights)
    assert fp(models) == base
    assert counted_opens[weights] == 2
    # a new size: read again
    (models / "target" / "model.safetensors").write_bytes(b"\0" * 1001)
    assert describe_changes(base, fp(models)) == ["model.target"]
    assert counted_opens[weights] == 3


def poisoned_cache(private_cache, file, **change):
    """A cache entry for ``file`` whose stat matches but whose digest is wrong, with ``change``
    applied to its key: what the cache returns shows whether it trusted the entry."""
    st = os.stat(file)
    entry = {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
        "sha256": "0" * 64,
        "used": 0,
        **change,
    }
    private_cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    (private_cache / "digests.json").write_text(
        json.dumps({"version": 1, "entries": {os.path.realpath(file): entry}})
    )


@pytest.mark.parametrize("key", [None, "size", "mtime_ns", "ctime_ns", "ino", "dev"])
def test_the_cache_is_keyed_by_size_mtime_ctime_inode_and_device(tmp_path, private_cache, key):
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"weights")
    real = hashlib.sha256(b"weights").hexdigest()
    st = os.stat(file)
    moved = {
        "size": st.st_size + 1,
        "mtime_ns": st.st_mtime_ns + 1,
        "ctime_ns": st.st_ctime_ns + 1,
        "ino": st.st_ino + 1,
        "dev": st.st_dev + 1,
    }
    poisoned_cache(private_cache, file, **({} if key is None else {key: moved[key]}))
    # all five match: the entry is trusted; any one differs: the file is read
    assert DigestCache().digest(file) == ("0" * 64 if key is None else real)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b"\0\xff" * 50,
        b"[]",
        b'{"version": 1}',
        b'{"version": 1, "entries": []}',
        b'{"version": 9, "entries": {}}',
        b'{"version": 1, "entries": {"/x": {"sha256": 5}}}',
    ],
)
def test_a_corrupt_cache_is_ignored_and_rebuilt(
    models, no_racy_window, private_cache, counted_opens, content
):
    base = fp(models)
    weights = os.path.realpath(models / "target" / "model.safetensors")
    (private_cache / "digests.json").write_bytes(content)
    assert fp(models) == base
    assert counted_opens[weights] == 2  # read again: the corrupt file held no digest
    json.loads((private_cache / "digests.json").read_text())  # rewritten whole
    assert fp(models) == base
    assert counted_opens[weights] == 2


def test_a_file_written_a_moment_ago_is_not_cached(models, private_cache, monkeypatch):
    """On a filesystem with one-second timestamps a second write in the same second would
    keep size, mtime and ctime: such a file is hashed every time until it is older."""
    assert fingerprint_mod.RACY_NS >= 1_000_000_000
    monkeypatch.setattr(fingerprint_mod, "RACY_NS", 3600 * 10**9)  # "a moment", however slow
    base = fp(models)
    assert fp(models) == base
    entries = (
        json.loads((private_cache / "digests.json").read_text())["entries"]
        if (private_cache / "digests.json").exists()
        else {}
    )
    assert os.path.realpath(models / "target" / "model.safetensors") not in entries


def test_a_cache_directory_others_could_write_is_not_trusted(tmp_path, private_cache):
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"weights")
    real = hashlib.sha256(b"weights").hexdigest()
    poisoned_cache(private_cache, file)
    os.chmod(private_cache, 0o777)  # ours: made private again, then used
    assert DigestCache().digest(file) == "0" * 64
    assert stat.S_IMODE(os.stat(private_cache).st_mode) == 0o700
    if os.geteuid() != 0:
        return  # handing the directory to another user needs root
    os.chown(private_cache, 4242, 4242)  # someone else's: never read
    assert DigestCache().digest(file) == real


def test_no_writable_cache_directory_is_slower_never_wrong(
    models, monkeypatch, tmp_path, no_racy_window, counted_opens
):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # cannot hold a directory
    base = fp(models)
    assert fp(models) == base
    assert counted_opens[os.path.realpath(models / "target" / "model.safetensors")] == 2
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored, per XDG
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fp(models) == base
    assert (tmp_path / "home" / ".cache" / "batchspec" / "digests.json").exists()


def test_concurrent_savers_leave_a_whole_cache(tmp_path, private_cache, no_racy_window):
    files = []
    for i in range(40):
        files.append(tmp_path / f"f{i}.bin")
        files[-1].write_bytes(str(i).encode())

    def saver(mine):
        for file in mine:
            cache = DigestCache()
            cache.digest(file)
            cache.save()

    threads = [threading.Thread(target=saver, args=(files[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = json.loads((private_cache / "digests.json").read_text())["entries"]
    assert entries and all(os.path.realpath(f) in map(os.path.realpath, files) for f in entries)
    assert [p.name for p in private_cache.iterdir()] == ["digests.json"]
    for file in files:  # every digest right, whether it was kept or lost to a race
        assert DigestCache().digest(file) == hashlib.sha256(file.read_bytes()).hexdigest()


def test_hub_ids_are_not_hashed_and_leave_no_cache(models, private_cache):
    hub = fp(models, model__target="org/some-model", speculative=None)
    assert hub == fp(models, model__target="org/some-model", speculative=None)
    assert not private_cache.exists()
