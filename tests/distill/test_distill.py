"""batchspec distill: the vocabulary check (before any engine), the training batch layout, and a
small distillation end to end on the real engine (tiny pair, JSON-domain prompts): the card,
acceptance before and after, and a restart that reuses the generated data.

Without an engine: one writer per --out (a second distill exits 1 naming the holder; the lock is
the kernel's, never followed through a planted link), chunks written under names of their own and
fsynced, a torn chunk regenerated, the draft built aside and renamed into place with its card
last, --out refused (exit 2) where it overlaps the job's input, output, target or draft, and the
card's public view of the job.

Engine time: about 2 minutes (four engine starts: generation, two evaluations, one restart; the
refusal reuses the generated data and starts none).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from domain_data import write_shards
from helpers.jobs import DRAFT, ENGINE, MODELS, ROOT, run_cli, run_cli_in_process, write_job

import batchspec.distill.data as distill_data
import batchspec.distill.session as distill_mod
import batchspec.distill.train as distill_train
from batchspec.distill import outdir as outdir_mod
from batchspec.distill.data import GENERATED_SCHEMA, _write_chunk, generate, read_generated, topk_lists
from batchspec.distill.options import DistillOptions
from batchspec.distill.outdir import CARD_NAME, OutLock, work_dir
from batchspec.distill.session import check_options, check_out
from batchspec.distill.train import _batch, prepare_examples
from batchspec.errors import RuntimeFailure, SpecError
from batchspec.spec.load import load_spec

K = 2


#: The two adapters make models trains; a job with ``lora=True`` routes its rows to them.
LORA = {"adapters": {"upper": str(MODELS / "lora-upper"), "comment": str(MODELS / "lora-comment")}}


def _job(tmp: Path, models: Path, rows: int = 60, lora: bool = False) -> Path:
    """A job over two shards of held-out prompts; with ``lora``, rows name an adapter in turn
    (upper, comment, or null: the base model), so the target's text is theirs."""
    paths = write_shards(tmp / "prompts", rows=rows, shards=2, seed=3)
    if lora:
        turn = [None, *LORA["adapters"]]
        for path in paths:
            table = pq.read_table(path)
            pq.write_table(
                table.append_column(
                    "adapter", pa.array([turn[i % len(turn)] for i in range(table.num_rows)], pa.string())
                ),
                path,
            )
    return write_job(
        tmp / "job.yaml",
        input={
            "path": str(tmp / "prompts" / "*.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            **({"lora_column": "adapter"} if lora else {}),
        },
        output={"path": str(tmp / "run-out")},
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE), **({"lora": LORA} if lora else {})},
        speculative={**DRAFT, "num_speculative_tokens": K},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
    )


def _bad_draft(tmp: Path, models: Path, what: str) -> Path:
    """A copy of the tiny draft whose tokenizer (or config) differs from the target's."""
    bad = tmp / f"draft-{what}"
    shutil.copytree(models / "draft", bad)
    if what == "tokenizer":
        tok = json.loads((bad / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = (next(t for t, i in vocab.items() if i == n) for n in (1000, 1001))
        vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens, two of them with other ids
        (bad / "tokenizer.json").write_text(json.dumps(tok))
    else:
        config = json.loads((bad / "config.json").read_text())
        config["vocab_size"] = 4096
        (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("what", ["tokenizer", "vocab_size"])
def test_a_draft_with_another_vocabulary_exits_2_before_any_engine(tmp_path, models, what):
    job = _job(tmp_path, models, rows=8)
    out = tmp_path / "new-draft"
    done = run_cli_in_process(
        "distill",
        str(job),
        "--draft",
        str(_bad_draft(tmp_path, models, what)),
        "--out",
        str(out),
    )
    assert done.returncode == 2, done.stderr
    assert "bad job spec" in done.stderr and "--draft" in done.stderr
    assert ("different tokenizers" if what == "tokenizer" else "vocabulary sizes") in done.stderr
    # refused before any work: no engine log, nothing generated, no output or work directory
    assert "vLLM's own output" not in done.stderr
    assert not out.exists() and not work_dir(out).exists()
    assert done.stdout == ""


@pytest.mark.vllm
def test_training_batch_predicts_the_continuation_only():
    examples = [
        {
            "prompt_token_ids": [5, 6, 7],
            "output_token_ids": [8, 9],
            "topk_token_ids": [[8, 3], [9, 4]],
            "topk_logprobs": [[-0.1, -2.5], [-0.2, -1.9]],
        },
        {
            "prompt_token_ids": [5],
            "output_token_ids": [10, 11, 12],
            "topk_token_ids": None,
            "topk_logprobs": None,
        },
    ]
    ids, mask, labels, teacher = _batch(prepare_examples(examples), [0, 1], pad_id=0, topk=True)
    # inputs are prompt + continuation less its last token; labels are the next tokens, where
    # the next token is the target's
    assert ids.tolist() == [[5, 6, 7, 8], [5, 10, 11, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[-100, -100, 8, 9], [10, 11, 12, -100]]
    t_ids, t_prob = teacher
    assert t_ids[0, 2].tolist() == [8, 3] and t_ids[0, 3].tolist() == [9, 4]
    assert abs(t_prob[0, 2].sum().item() - 1) < 1e-6 and t_prob[0, 2, 0] > t_prob[0, 2, 1]
    assert t_prob[1].sum().item() == 0  # no top-K kept for that row: no KL term there


def test_topk_lists_most_likely_first():
    class LP:
        def __init__(self, v):
            self.logprob = v

    ids, values = topk_lists([{4: LP(-3.0), 7: LP(-0.5), 1: LP(-1.0)}])
    assert ids == [[7, 1, 4]] and values == [[-0.5, -1.0, -3.0]]


# --------------------------------------------------------------------------- no engine


def _spec_job(tmp: Path, **extra) -> Path:
    """A job whose input does not exist: a distill that got past its refusals exits 3 at once
    (never starts an engine), so a refusal that is missing shows as a wrong exit code."""
    sections = {
        "input": {"path": str(tmp / "data" / "prompts" / "*.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(tmp / "run-out")},
        "model": {"target": str(tmp / "models" / "target"), "engine": {}},
    }
    sections.update(extra)
    return write_job(tmp / "job.yaml", **sections)


def _holder_process(out: Path) -> subprocess.Popen:
    """Another process holding --out's lock until it is killed."""
    code = (
        "import sys, time\nfrom batchspec.distill.outdir import OutLock\n"
        "OutLock.take(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_distill_on_one_out_exits_1_naming_the_holder(tmp_path):
    job = _spec_job(tmp_path)
    out = tmp_path / "new-draft"
    holder = _holder_process(out)
    try:
        done = run_cli_in_process("distill", str(job), "--init", "target", "--out", str(out))
        assert done.returncode == 1, done.stderr
        assert "--out" in done.stderr and "another batchspec distill" in done.stderr
        assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in done.stderr
        assert "vLLM's own output" not in done.stderr and not out.exists()
        with pytest.raises(RuntimeFailure, match=f"pid {holder.pid}"):
            OutLock.take(out)  # also within one process: flock is per open file
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel freed the dead holder's lock: nobody has to delete anything
    with OutLock.take(out) as lock:
        assert lock.record["pid"] == os.getpid()
        with pytest.raises(RuntimeFailure, match=f"pid {os.getpid()}"):
            OutLock.take(out)
    OutLock.take(out).release()  # released: free again


def test_the_out_lock_never_follows_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "lock").write_text("precious\n")
    out = tmp_path / "new-draft"
    work_dir(out).symlink_to(victim)  # the work directory is a link to someone else's
    done = run_cli_in_process("distill", str(_spec_job(tmp_path)), "--init", "target", "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert "--out" in done.stderr and "symbolic link" in done.stderr
    assert (victim / "lock").read_text() == "precious\n"
    work_dir(out).unlink()
    work_dir(out).mkdir(mode=0o700)
    (work_dir(out) / "lock").symlink_to(victim / "lock")  # the lock file is a link
    with pytest.raises(SpecError, match="--out"):
        OutLock.take(out)
    assert (victim / "lock").read_text() == "precious\n"


def _rows(prefix: str, n: int) -> list[dict]:
    return [
        {
            "request_id": f"{prefix}-{i}",
            "prompt_token_ids": [1, 2],
            "output_token_ids": [3, i],
            "topk_token_ids": None,
            "topk_logprobs": None,
            "finish_reason": "length",
        }
        for i in range(n)
    ]


def test_concurrent_chunk_writers_never_share_or_lose_a_chunk(tmp_path):
    directory = tmp_path / "generated-x"
    writers, chunks = 8, 3
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            for c in range(chunks):
                barrier.wait(timeout=30)  # every writer names its chunk at the same moment
                _write_chunk(directory, _rows(f"w{w}c{c}", 50))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()  # the others stop waiting for this one

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    parts = sorted(directory.glob("part-*.parquet"))
    assert len(parts) == writers * chunks
    for part in parts:
        pq.read_table(part, schema=GENERATED_SCHEMA)  # every chunk whole
    table = read_generated(directory)
    ids = table.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == writers * chunks * 50
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_a_chunk_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    directory = tmp_path / "generated-x"
    part = _write_chunk(directory, _rows("a", 3))
    renamed = [e for e in events if e[0] == "replace"]
    assert len(renamed) == 1
    tmp = renamed[0][1]
    i = events.index(renamed[0])
    assert ("fsync", tmp) in events[:i]  # the bytes first
    assert ("fsync", str(directory)) in events[i:]  # then the rename
    assert part.exists() and not Path(tmp).exists()


def test_a_torn_chunk_is_deleted_and_its_rows_generated_again(tmp_path, monkeypatch):
    directory = tmp_path / "generated-x"
    rows = [SimpleNamespace(request_id=f"r-{i}") for i in range(9)]
    good = _write_chunk(directory, [dict(r, request_id=f"r-{i}") for i, r in enumerate(_rows("x", 3))])
    torn = _write_chunk(directory, [dict(r, request_id=f"r-{i + 3}") for i, r in enumerate(_rows("x", 3))])
    cut = _write_chunk(directory, [dict(r, request_id=f"r-{i + 6}") for i, r in enumerate(_rows("x", 3))])
    torn.write_bytes(b"PAR1 not a parquet file at all")
    cut.write_bytes(cut.read_bytes()[:-40])  # a chunk cut short
    (directory / ".part-00009-1-abc.parquet.tmp").write_bytes(b"half")  # a killed writer's
    asked: list[list[str]] = []

    def fake_generate_missing(spec, todo, directory, logprobs, say, interval_s, chunk_rows, windows=1):
        asked.append([r.request_id for r in todo])
        _write_chunk(
            directory,
            [dict(x, request_id=r.request_id) for x, r in zip(_rows("y", len(todo)), todo, strict=True)],
        )
        return 0

    monkeypatch.setattr(distill_data, "_generate_missing", fake_generate_missing)
    said: list[str] = []
    gen = generate(None, rows, directory, 0, said.append)
    assert asked == [[f"r-{i}" for i in range(3, 9)]]  # the torn chunks' rows, nothing else
    assert sum("cannot be read" in m and "deleted" in m for m in said) == 2, said
    assert gen.table.column("request_id").to_pylist() == [r.request_id for r in rows]
    assert (gen.generated_rows, gen.reused_rows) == (6, 3)
    assert good.exists() and not torn.exists() and not cut.exists()
    assert not list(directory.glob("*.tmp"))
    # and the next run with the same options reads everything back
    assert read_generated(directory).num_rows == 9


@pytest.fixture
def overlap_job(tmp_path):
    """A job with its input, output, target and draft as real directories."""
    for d in ("data/prompts", "run-out", "models/target", "models/draft", "models/spec-draft"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "link-to-out").symlink_to(tmp_path / "run-out")
    job = _spec_job(
        tmp_path,
        speculative={
            "method": "draft_model",
            "model": str(tmp_path / "models" / "spec-draft"),
            "num_speculative_tokens": 2,
        },
    )
    return tmp_path, load_spec(job)


@pytest.mark.parametrize(
    "out,draft,what",
    [
        ("data/prompts", None, "is the same location as the job's input location"),
        ("data/prompts/draft", None, "lies inside the job's input location"),
        ("data", None, "contains the job's input location"),
        ("models/../data/prompts/", None, "is the same location as the job's input location"),
        ("run-out", None, "is the same location as the job's output.path"),
        ("link-to-out/new", None, "lies inside the job's output.path"),
        ("models/target", None, "is the same location as the job's target"),
        ("models/target/sub", None, "lies inside the job's target"),
        ("models", None, "contains the job's target"),  # the parent of the target (and the drafts)
        ("models/draft", "models/draft", "is the same location as the current draft (--draft)"),
        ("models/spec-draft", None, "is the same location as the job's draft (speculative.model)"),
    ],
)
def test_an_out_overlapping_the_job_is_refused(overlap_job, out, draft, what):
    tmp, spec = overlap_job
    opts = DistillOptions(
        out=tmp / out, draft=str(tmp / draft) if draft else None, init="draft" if draft else "target"
    )
    with pytest.raises(SpecError) as info:
        check_options(spec, opts)
    assert info.value.key == "--out" and what in str(info.value), str(info.value)


def test_an_out_beside_the_job_s_models_is_accepted(overlap_job):
    tmp, spec = overlap_job
    check_out(spec, DistillOptions(out=tmp / "models" / "draft-my-job", draft=str(tmp / "models" / "draft")))
    (tmp / "models" / "draft-my-job").mkdir()
    (tmp / "models" / "draft-my-job" / "notes.txt").write_text("mine")  # not a draft: kept
    with pytest.raises(SpecError, match="holds no batchspec-model.json"):
        check_out(spec, DistillOptions(out=tmp / "models" / "draft-my-job", init="target"))


def test_distill_into_the_job_s_output_exits_2_before_any_engine(tmp_path):
    job = _spec_job(tmp_path)
    out = tmp_path / "run-out"
    done = run_cli_in_process("distill", str(job), "--init", "target", "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert "bad job spec: --out" in done.stderr and "output.path" in done.stderr
    assert "vLLM's own output" not in done.stderr
    assert not out.exists() and not work_dir(out).exists()


@pytest.fixture
def fake_pipeline(monkeypatch):
    """distill() with its engine, torch and transformers steps replaced by fakes that write a
    small model directory (``on_save`` runs first, with the directory being written)."""
    state = SimpleNamespace(on_save=None, saved=[])
    rows = [SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    monkeypatch.setattr(
        distill_data,
        "draw_sample",
        lambda spec, size, heldout, seed: distill_data.Sample(train=rows, heldout=[], population=4),
    )

    def generate(spec, train, directory, logprobs, say, chunk_rows, windows=1):
        table = pa.Table.from_pylist(
            [dict(r, request_id=t.request_id) for r, t in zip(_rows("g", len(train)), train, strict=True)],
            schema=GENERATED_SCHEMA,
        )
        return distill_data.Generated(
            table=table,
            generated_rows=len(train),
            reused_rows=0,
            failed_rows=0,
            wall_s=0.0,
            directory=directory,
        )

    monkeypatch.setattr(distill_data, "generate", generate)
    draft = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=1), parameters=lambda: [SimpleNamespace(numel=lambda: 7)]
    )
    monkeypatch.setattr(distill_train, "draft_from_target", lambda target, layers: draft)
    monkeypatch.setattr(distill_train, "load_draft", lambda path: draft)
    monkeypatch.setattr(distill_train, "check_vocabulary", lambda target, draft, key="--draft": None)
    monkeypatch.setattr(distill_train, "tokenizer_vocab", lambda path: ({}, {"pad": 0, "eos": 0}))
    monkeypatch.setattr(
        distill_train,
        "train_draft",
        lambda *a, **k: distill_train.TrainResult(
            steps=1, loss=0.5, top1_agreement=0.5, wall_s=0.0, device="cpu"
        ),
    )

    def save_draft(d, tokenizer_dir, out):
        if state.on_save:
            state.on_save(Path(out))
        (Path(out) / "config.json").write_text("{}")
        (Path(out) / "model.safetensors").write_bytes(b"new weights")
        state.saved.append(Path(out))

    monkeypatch.setattr(distill_train, "save_draft", save_draft)
    return state


def _old_draft(out: Path) -> dict:
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / CARD_NAME).write_text('{"role": "draft", "old": true}\n')
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_distill_that_dies_while_saving_leaves_the_previous_draft_whole(tmp_path, fake_pipeline):
    spec = load_spec(_spec_job(tmp_path))
    out = tmp_path / "new-draft"
    before = _old_draft(out)

    def die(directory: Path):
        (directory / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed while saving")

    fake_pipeline.on_save = die
    with pytest.raises(RuntimeError, match="killed while saving"):
        distill_mod.distill(spec, DistillOptions(out=out, init="target", evaluate=False))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # card and weights as were
    assert not list(work_dir(out).glob("model-*"))  # the half-built draft is gone
    OutLock.take(out).release()  # and the lock was given back


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "move-aside"])
def test_the_new_draft_is_built_aside_and_renamed_in_with_its_card_last(
    tmp_path, fake_pipeline, monkeypatch, exchange
):
    spec = load_spec(_spec_job(tmp_path))
    out = tmp_path / "new-draft"
    before = _old_draft(out)
    seen: dict = {}

    def on_save(directory: Path):
        seen["built_in"] = directory
        seen["out_while_building"] = {p.name: p.read_bytes() for p in out.iterdir()}

    real_exchange, real_rename = outdir_mod._exchange, os.rename

    def spy_exchange(a, b):
        seen.setdefault("card_at_swap", (Path(a) / CARD_NAME).exists())
        return real_exchange(a, b) if exchange else False

    def spy_rename(src, dst):
        if Path(dst) == out:
            seen.setdefault("card_at_swap", (Path(src) / CARD_NAME).exists())
        return real_rename(src, dst)

    monkeypatch.setattr(outdir_mod, "_exchange", spy_exchange)
    monkeypatch.setattr(distill_mod.os, "rename", spy_rename)
    fake_pipeline.on_save = on_save
    result = distill_mod.distill(spec, DistillOptions(out=out, init="target", evaluate=False))
    assert seen["built_in"].parent == work_dir(out)  # aside, on the same filesystem
    assert seen["out_while_building"] == before  # --out untouched while the draft was built
    assert seen["card_at_swap"] is True  # the card was in before the directory went in
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    card = json.loads((out / CARD_NAME).read_text())
    assert card == result.card and "old" not in card and card["parameters"] == 7
    leftovers = [p.name for p in work_dir(out).iterdir() if p.name.startswith(("model-", "replac"))]
    assert leftovers == []


def test_the_card_carries_the_public_view_of_the_job(tmp_path, fake_pipeline, monkeypatch):
    monkeypatch.setenv("BS_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("BS_HF_TOKEN", "hf_env_secret_4711")
    job = tmp_path / "job.yaml"
    job.write_text(f"""
name: card-job
input: {{path: "{tmp_path}/data/prompts/*.parquet", prompt_column: prompt}}
output: {{path: "s3://AKIAUSERX:pw-secret-99@bucket/out?X-Amz-Signature=sig-secret-77"}}
model:
  target: ${{BS_MODELS}}/target
  engine: {{hf_token: "${{BS_HF_TOKEN}}", max_model_len: 512}}
sampling: {{temperature: 0.0, max_tokens: 8}}
""")
    overrides = ("model.engine.hf_token=hf_literal_secret_0815", "sampling.max_tokens=16")
    spec = load_spec(job, overrides)
    out = tmp_path / "new-draft"
    distill_mod.distill(
        spec, DistillOptions(out=out, init="target", evaluate=False, job_path=str(job), overrides=overrides)
    )
    text = (out / CARD_NAME).read_text()
    card = json.loads(text)
    assert card["target"] == "${BS_MODELS}/target"  # as written
    assert card["job"]["spec"]["model"]["target"] == "${BS_MODELS}/target"
    assert card["sampling"] == {"temperature": 0.0, "max_tokens": 16}  # --set applied
    assert card["job"]["spec"]["model"]["engine"]["hf_token"] == "***"
    assert card["job"]["spec"]["output"]["path"] == "s3://bucket/out"
    for secret in (
        "hf_env_secret_4711",
        "hf_literal_secret_0815",
        "pw-secret-99",
        "AKIAUSERX",
        "sig-secret-77",
        str(tmp_path / "models"),
    ):
        assert secret not in text, secret


def _gate_setup(tmp_path, monkeypatch, old_rate: float, new_rate: float):
    """distill() on fakes with 20 held-out prompts, the starting drafter at ``old_rate``
    acceptance and the new one at ``new_rate`` (each prompt +-0.1 around it)."""
    heldout = [SimpleNamespace(request_id=f"h{i}") for i in range(20)]
    train = [SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    monkeypatch.setattr(
        distill_data,
        "draw_sample",
        lambda spec, size, heldout_n, seed: distill_data.Sample(train=train, heldout=heldout, population=24),
    )
    old = tmp_path / "old-draft"
    old.mkdir()

    def evaluate(spec, draft, rows, k, concurrency, say=None, counts=None, method="draft_model"):
        rate = old_rate if draft == str(old) else new_rate
        for i, row in enumerate(rows):
            counts[row.request_id] = (round((rate + (0.1 if i % 2 else -0.1)) * 1000), 1000)
        return {"acceptance_rate": rate, "draft": draft}

    monkeypatch.setattr(distill_mod, "evaluate", evaluate)
    return load_spec(_spec_job(tmp_path)), old


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "old-out"])
def test_a_new_drafter_within_the_noise_is_not_installed(tmp_path, fake_pipeline, monkeypatch, existing):
    spec, old = _gate_setup(tmp_path, monkeypatch, old_rate=0.40, new_rate=0.401)
    out = tmp_path / "new-draft"
    before = _old_draft(out) if existing else None
    with pytest.raises(distill_mod.NotInstalled) as info:
        distill_mod.distill(spec, DistillOptions(out=out, draft=str(old)))
    assert info.value.exit_code == 4
    message = str(info.value)
    assert "not more than the noise margin" in message and "--force installs anyway" in message
    assert ("was left as it was" if existing else "was not created") in message
    decision = info.value.result.decision
    assert decision["install"] is False and decision["gain"] == 0.001 and decision["margin"] > 0.001
    assert info.value.result.before["acceptance_rate"] == 0.40
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert fake_pipeline.saved and not list(work_dir(out).glob("model-*"))  # built, then removed
    OutLock.take(out).release()


def test_force_installs_a_drafter_within_the_noise(tmp_path, fake_pipeline, monkeypatch):
    spec, old = _gate_setup(tmp_path, monkeypatch, old_rate=0.40, new_rate=0.39)
    out = tmp_path / "new-draft"
    result = distill_mod.distill(spec, DistillOptions(out=out, draft=str(old), force=True))
    card = json.loads((out / CARD_NAME).read_text())
    assert result.decision["install"] and result.decision["forced"] and card["decision"] == result.decision
    assert (out / "model.safetensors").read_bytes() == b"new weights"


def test_a_drafter_that_beats_the_noise_is_installed(tmp_path, fake_pipeline, monkeypatch):
    spec, old = _gate_setup(tmp_path, monkeypatch, old_rate=0.40, new_rate=0.55)
    out = tmp_path / "new-draft"
    result = distill_mod.distill(spec, DistillOptions(out=out, draft=str(old)))
    assert result.decision["install"] and not result.decision["forced"]
    assert result.decision["gain"] == 0.15 and result.decision["margin"] < 0.15
    assert json.loads((out / CARD_NAME).read_text())["acceptance"]["after"]["draft"] == str(out)


def test_training_that_never_beats_the_start_installs_nothing_without_evaluating(
    tmp_path, fake_pipeline, monkeypatch
):
    spec, old = _gate_setup(tmp_path, monkeypatch, old_rate=0.40, new_rate=0.40)
    monkeypatch.setattr(
        distill_train,
        "train_draft",
        lambda *a, **k: distill_train.TrainResult(
            steps=30, loss=0.5, top1_agreement=0.5, wall_s=0.0, device="cpu", best_step=0,
            start_validation_agreement=0.61, stopped_early=True,
        ),
    )  # fmt: skip
    monkeypatch.setattr(distill_mod, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    out = tmp_path / "new-draft"
    with pytest.raises(distill_mod.NotInstalled, match="never raised the validation figure"):
        distill_mod.distill(spec, DistillOptions(out=out, draft=str(old)))
    assert not out.exists() and not fake_pipeline.saved


@pytest.mark.parametrize("flag", ["--no-eval", "--holdout"])
def test_no_comparison_with_a_starting_drafter_needs_force(overlap_job, flag):
    tmp, spec = overlap_job
    kwargs = {"evaluate": False} if flag == "--no-eval" else {"heldout": 0}
    opts = DistillOptions(out=tmp / "new", draft=str(tmp / "models" / "draft"), **kwargs)
    with pytest.raises(SpecError) as info:
        check_options(spec, opts)
    assert info.value.key == flag and "--force" in str(info.value)
    opts = DistillOptions(out=tmp / "new", init="target", **kwargs)  # no drafter to beat
    check_options(spec, opts)


# --------------------------------------------------------------------------- real engine


@dataclass
class Distilled:
    tmp: Path
    job: Path
    out: Path
    first: object
    result: dict
    card: dict


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, models) -> Distilled:
    """One distill of a job whose rows run with two LoRA adapters and the base model: the draft
    learns the text the job's target writes, each row's adapter included."""
    tmp = tmp_path_factory.mktemp("distill")
    job = _job(tmp, models, lora=True)
    out = tmp / "new-draft"
    done = run_cli(
        "distill",
        str(job),
        "--draft",
        str(models / "draft"),
        "--out",
        str(out),
        "--sample",
        "48",
        "--holdout",
        "12",
        "--steps",
        "30",
        "--batch-size",
        "8",
        "--logprobs",
        "4",
        "--chunk-rows",
        "16",
        "--force",  # installed whatever 30 steps gain: the install gate has its own tests
        "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads((out / "batchspec-model.json").read_text())
    return Distilled(tmp, job, out, done, json.loads(done.stdout), card)


@pytest.mark.engine
def test_distill_measures_acceptance_before_and_after(distilled, models):
    result = distilled.result
    assert set(result) == {"before", "after", "out", "decision"} and result["out"] == str(distilled.out)
    decision = result["decision"]
    assert decision["install"] and decision["prompts"] == 12 and decision["margin"] > 0
    assert decision["gain"] == round(
        result["after"]["acceptance_rate"] - result["before"]["acceptance_rate"], 4
    )
    assert decision["forced"] == (decision["gain"] <= decision["margin"])
    for side in ("before", "after"):
        m = result[side]
        assert 0 <= m["acceptance_rate"] <= 1
        assert 1 <= m["mean_acceptance_length"] <= K + 1
        assert len(m["acceptance_per_position"]) == K
        assert m["output_tokens_per_s"] > 0 and m["prompts"] == 12
    assert result["before"]["draft"] == str(models / "draft")
    assert result["after"]["draft"] == str(distilled.out)
    # the new weights are other weights, and vLLM loaded them as the draft (it measured them)
    assert result["before"]["acceptance_rate"] != result["after"]["acceptance_rate"]
    assert "train step 1/" in distilled.first.stderr and "top-1 agreement" in distilled.first.stderr
    assert "validation acceptance at k=" in distilled.first.stderr
    assert "window(s) of 24 tokens per prompt" in distilled.first.stderr


@pytest.mark.engine
def test_card_and_model_directory(distilled, models):
    card, out = distilled.card, distilled.out
    assert card["parent_draft"] == str(models / "draft")
    assert card["target"] == str(models / "target")
    assert card["job"]["name"] == "job" and card["sample_size"] == 33 and card["heldout_size"] == 12
    assert card["validation_size"] == 3  # a tenth of the 36 training prompts, at least 2
    assert card["steps"] == 30 and card["logprobs"] == 4
    # the sizing rule: the 1-layer draft's parameters / 32 ask for more than 33 x 24 tokens, and
    # the continuations stay the job's 24 tokens (more passes, not longer tails)
    assert card["data"]["windows"] == 1 and card["data"]["window"] == 24
    assert card["data"]["wanted_tokens"] > card["data"]["train_tokens"]
    assert card["training"]["steps_run"] <= card["data"]["steps_supported"] <= 30
    assert card["training"]["best_step"] is not None and card["decision"] == distilled.result["decision"]
    assert card["data_fingerprint"].startswith("sha256:")
    assert card["acceptance"]["before"] == distilled.result["before"]
    assert card["acceptance"]["after"] == distilled.result["after"]
    assert card["generation"] == {**card["generation"], "generated_rows": 36, "reused_rows": 0}
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    assert (out / "tokenizer.json").read_bytes() == (models / "target" / "tokenizer.json").read_bytes()
    # the card went in last, and nothing of the build is left behind
    assert (out / CARD_NAME).stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in out.iterdir())
    assert sorted(p.name for p in work_dir(out).iterdir() if not p.name.startswith("generated-")) == ["lock"]
    assert (work_dir(out) / "lock").read_text() == ""  # released
    assert card["job"]["spec"]["model"]["target"] == str(models / "target")
    assert card["lora"] == LORA  # the adapters whose outputs the draft learned
    # the top-K was kept for every generated token
    chunks = sorted(work_dir(out).glob("generated-*/part-*.parquet"))
    assert len(chunks) == 3  # 36 rows in chunks of 16
    rows = pq.read_table(chunks[0]).to_pylist()
    lengths = [(len(r["topk_token_ids"]), len(r["output_token_ids"])) for r in rows]
    # each continuation asked for the job's 24 tokens (a row may stop sooner, at its end token)
    assert all(k == n <= 24 for k, n in lengths), lengths
    assert max(n for _, n in lengths) == 24, lengths
    assert all(r["topk_token_ids"][0][0] == r["output_token_ids"][0] for r in rows)  # greedy


@pytest.mark.engine
def test_a_drafter_no_better_than_the_old_one_is_not_installed(distilled, models):
    """Training at a learning rate that changes nothing: validation acceptance never rises above
    the starting draft's, so nothing is installed (exit 4) and --out keeps the draft there."""
    kept = {p.name: p.read_bytes() for p in distilled.out.iterdir()}
    done = run_cli(
        "distill",
        str(distilled.job),
        "--draft",
        str(models / "draft"),
        "--out",
        str(distilled.out),
        "--sample",
        "48",
        "--holdout",
        "12",
        "--steps",
        "20",
        "--lr",
        "1e-12",
        "--batch-size",
        "8",
        "--logprobs",
        "4",
        "--chunk-rows",
        "16",
        "--json",
    )
    assert done.returncode == 4, done.stderr[-3000:]
    assert "not installed" in done.stderr and "--force installs anyway" in done.stderr
    assert "all 36 continuations already generated" in done.stderr  # the fixture's data, reused
    result = json.loads(done.stdout)
    assert result["decision"]["install"] is False and result["after"] is None
    assert {p.name: p.read_bytes() for p in distilled.out.iterdir()} == kept
    assert not list(work_dir(distilled.out).glob("model-*"))


@pytest.mark.engine
def test_a_restart_reuses_the_generated_data(distilled):
    chunks = sorted(work_dir(distilled.out).glob("generated-*/part-*.parquet"))
    kept = {p: p.stat().st_mtime_ns for p in chunks[:-1]}
    lost = pq.read_metadata(chunks[-1]).num_rows
    chunks[-1].unlink()  # as if the run had been killed before committing its last chunk
    done = run_cli(
        "distill",
        str(distilled.job),
        "--draft",
        str(distilled.out.parent / "x"),
        "--init",
        "target",
        "--layers",
        "1",
        "--out",
        str(distilled.out),
        "--sample",
        "48",
        "--holdout",
        "12",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--logprobs",
        "4",
        "--chunk-rows",
        "16",
        "--no-eval",
    )
    assert done.returncode == 2, done.stderr  # a --draft that does not exist: refused first
    done = run_cli(
        "distill",
        str(distilled.job),
        "--init",
        "target",
        "--layers",
        "1",
        "--out",
        str(distilled.out),
        "--sample",
        "48",
        "--holdout",
        "12",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--logprobs",
        "4",
        "--chunk-rows",
        "16",
        "--no-eval",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    card = json.loads((distilled.out / "batchspec-model.json").read_text())
    assert card["generation"]["generated_rows"] == lost
    assert card["generation"]["reused_rows"] == 36 - lost
    assert f"generating the target's continuations of {lost} prompts" in done.stderr
    assert all(p.stat().st_mtime_ns == m for p, m in kept.items())  # never rewritten
    assert card["data_fingerprint"] == distilled.card["data_fingerprint"]  # the same data
    assert card["init"] == "target" and card["parent_draft"] is None and card["layers"] == 1
    assert json.loads(done.stdout) == {
        "before": None,
        "after": None,
        "out": str(distilled.out),
        "decision": {
            "install": True,
            "gain": None,
            "margin": None,
            "prompts": 0,
            "forced": False,
            "reason": "no starting drafter to compare with",
        },
    }


def test_distill_generates_one_sample_with_its_own_logprobs_and_keeps_the_jobs_constraint(tmp_path):
    """A job with n samples, logprobs and a structured-outputs constraint (job-wide and per row):
    distill's generation asks for one sample per prompt (the target's distribution), distill's
    own top-K (or none), no prompt logprobs, and keeps the constraint a draft should learn."""
    from batchspec.distill.data import generation_request
    from batchspec.io.reader import Row

    job = write_job(
        tmp_path / "job.yaml",
        input={
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "prompt",
            "sampling_columns": {"n": "n", "logprobs": "lp", "structured_outputs.choice": "labels"},
        },
        output={"path": str(tmp_path / "out")},
        sampling={
            "temperature": 0.0,
            "max_tokens": 8,
            "n": 3,
            "logprobs": 5,
            "prompt_logprobs": 2,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    spec = load_spec(job)
    rows = [
        Row("s", 0, "s/0", {}, prompt="a", overrides={"n": 4, "logprobs": 1, "seed": 7}),
        Row("s", 1, "s/1", {}, prompt="b", overrides={"structured_outputs.choice": ["x"]}),
    ]
    for asked, want in ((0, None), (3, 3)):
        gen, gen_rows = generation_request(spec, rows, asked)
        assert gen.sampling.get("logprobs") == want and gen.sampling["n"] == 1
        assert "prompt_logprobs" not in gen.sampling and gen.speculative is None
        assert gen.sampling["structured_outputs"] == {"choice": ["yes", "no"]}
        assert gen.input.sampling_columns == {"structured_outputs.choice": "labels"}
        assert [r.overrides for r in gen_rows] == [{"seed": 7}, {"structured_outputs.choice": ["x"]}]
    assert rows[0].overrides == {"n": 4, "logprobs": 1, "seed": 7}  # the caller's rows as given


def test_distill_trains_on_an_openai_batch_jobs_lines_with_their_own_sampling(tmp_path):
    """An OpenAI Batch job's request file: distill samples the lines that run (not the refused
    one), and generates each with its body's sampling, one sample, distill's own logprobs."""
    from batchspec.distill.data import generation_request

    lines = [
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "t",
                    "n": 3,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "max_tokens": 10 + i,
                    "temperature": 0.5,
                    "seed": i,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                },
            }
        )
        for i in range(8)
    ]
    lines.insert(3, "{not json")
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "requests.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "batches" / "*.jsonl"), "format": "openai"},
        output={"path": str(tmp_path / "results"), "format": "openai"},
        model={"target": "t"},
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    spec = load_spec(job)
    sample = distill_data.draw_sample(spec, size=20, heldout=2, seed=5)
    rows = sample.train + sample.heldout
    assert sample.population == 8 and len(sample.heldout) == 2
    assert sorted(r.request_id for r in rows) == [f"c{i}" for i in range(8)]
    _, gen_rows = generation_request(spec, rows, 4)
    for row in gen_rows:
        i = int(row.request_id[1:])
        assert row.messages == [{"role": "user", "content": f"question {i}"}]
        assert row.overrides == {"max_tokens": 10 + i, "temperature": 0.5, "seed": i}
