"""``batchspec distill``: fit a draft to the job's own prompts.

1. a seeded sample of the job's prompts, part of it held out (:mod:`batchspec.distill_data`);
2. the target's continuations of the rest, speculation off, the job's sampling, resumable;
3. training with torch (:mod:`batchspec.distill_train`);
4. a model directory vLLM loads as a draft, built aside;
5. evaluation on the held-out prompts with speculation on, the old draft and the new;
6. the card ``batchspec-model.json`` written last into the new directory, which is then renamed
   into place as ``--out`` (a previous draft there is swapped out atomically where the kernel can
   exchange two directories, else moved aside first): ``--out`` is always either a whole draft
   with its card or no draft at all.

One writer per ``--out``: an flock on ``<work>/lock``, where ``<work>`` is the private directory
``.<name>.batchspec-distill`` beside ``--out`` (generated data, the draft being built); the kernel
frees it when its holder dies, and a second distill exits 1 naming the holder.

One vLLM engine at a time: each is shut down before the next starts. Every refusal (options,
``--out`` overlapping the job's input, output, target or draft, the vocabulary check) comes
before any of it, so a distill that cannot work exits 2 before any work.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime as dt
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from batchspec import __version__
from batchspec.errors import InputDataError, RuntimeFailure, SpecError
from batchspec.prompts import Row
from batchspec.redact import public_spec, sanitize_url
from batchspec.shards import fsync_dir, location_overlap, replace_durably, store_location
from batchspec.spec import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length
from batchspec.storage import this_host

CARD_NAME = "batchspec-model.json"
#: ``<parent>/.<name>.batchspec-distill``: the private work directory beside ``--out``.
WORK_SUFFIX = ".batchspec-distill"
LOCK_NAME = "lock"
#: Speculative tokens per step when the job names no draft.
DEFAULT_K = 4


@dataclass
class DistillOptions:
    """What ``batchspec distill`` was asked to do (its command-line options)."""

    out: Path
    draft: str | None = None
    #: "draft": start from ``draft``; "target": a new draft from the target's first ``layers``.
    init: str = "draft"
    layers: int = 1
    sample: int = 2000
    heldout: int = 200
    #: Keep the target's top-K log-probabilities per token for the KL term (0: cross-entropy only).
    logprobs: int = 0
    steps: int = 300
    lr: float = 2e-3
    batch_size: int = 16
    seed: int = 0
    #: Speculative tokens per step in the evaluation (None: the job's, else DEFAULT_K).
    k: int | None = None
    #: Requests in flight during the evaluation (None: the job's execution.max_in_flight).
    eval_concurrency: int | None = None
    evaluate: bool = True
    #: Generated rows per committed chunk (what a killed run can lose).
    chunk_rows: int = 128
    job_path: str | None = None
    #: The ``--set`` overrides, as given (the card shows them as written).
    overrides: tuple[str, ...] = ()


@dataclass
class DistillResult:
    out: str
    before: dict | None
    after: dict | None
    card: dict = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "out": self.out}


def _job_k(spec: JobSpec) -> int:
    spec_cfg = spec.speculative or {}
    return int(spec_cfg.get("num_speculative_tokens") or DEFAULT_K)


# --------------------------------------------------------------------------- where it writes


def out_dir(out: str | os.PathLike) -> Path:
    """``--out`` as an absolute path: its parent with symbolic links resolved, its own name as
    given (an ``--out`` that is itself a link is refused by :func:`check_options`)."""
    path = Path(os.path.abspath(out))
    return Path(os.path.realpath(path.parent)) / path.name


def work_dir(out: str | os.PathLike) -> Path:
    """The private directory beside ``--out``: the lock, the generated data (kept for a
    restart), the draft being built. On the same filesystem as ``--out``, so the finished draft
    is renamed into place, never copied."""
    path = out_dir(out)
    return path.parent / f".{path.name}{WORK_SUFFIX}"


def _overlap(out: Path, out_loc, url: str, options: dict, key: str, what: str,
             pattern: bool = False, local_only: bool = False) -> None:
    """SpecError("--out") when ``--out`` equals, lies inside or contains ``url``, judged by
    batchspec.shards' own rules (:func:`~batchspec.shards.store_location`,
    :func:`~batchspec.shards.location_overlap`: what a location names, not how it is spelled)."""
    if not url:
        return
    try:
        loc = store_location(url, options, key, pattern=pattern)
    except SpecError:
        if local_only:
            return  # a model id or a scheme with no backend here: not a local directory
        raise
    where = location_overlap(out_loc, loc)
    if where is not None:
        raise SpecError("--out", f"{out} {where} {what} ({sanitize_url(url)}): distill would "
                                 "write over or into it; write the new draft elsewhere")


def check_out(spec: JobSpec, opts: DistillOptions) -> None:
    """Refuse an ``--out`` that equals, lies inside or contains one of the job's own locations:
    its input, its ``output.path``, its target, the current draft (``--draft`` and the spec's
    ``speculative.model``); containing covers the parent of the draft or the target. Also refuse
    an ``--out`` that is a link, a file, or a directory that holds something other than a draft
    batchspec wrote (it would be replaced)."""
    out = out_dir(opts.out)
    if out.name in ("", ".", ".."):
        raise SpecError("--out", f"{opts.out}: name the directory the new draft goes to")
    out_loc = store_location(str(out), {}, "--out")
    for url in spec.input.paths:
        _overlap(out, out_loc, url, spec.input.storage_options, "input.path",
                 "the job's input location", pattern=True)
    _overlap(out, out_loc, spec.output.path, spec.output.storage_options, "output.path",
             "the job's output.path")
    _overlap(out, out_loc, spec.model.target, {}, "model.target", "the job's target (model.target)",
             local_only=True)
    if opts.draft:
        _overlap(out, out_loc, str(opts.draft), {}, "--draft", "the current draft (--draft)",
                 local_only=True)
    spec_draft = (spec.speculative or {}).get("model")
    if isinstance(spec_draft, str):
        _overlap(out, out_loc, spec_draft, {}, "speculative.model",
                 "the job's draft (speculative.model)", local_only=True)
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SpecError("--out", f"{opts.out} is a symbolic link: name the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError("--out", f"{opts.out} exists and is not a directory")
    if any(out.iterdir()) and not (out / CARD_NAME).is_file():
        raise SpecError("--out", f"{opts.out} exists, is not empty and holds no {CARD_NAME} (it "
                                 "is not a draft batchspec wrote): distill replaces its --out "
                                 "whole; choose an empty or new directory")


def check_options(spec: JobSpec, opts: DistillOptions) -> None:
    """Everything that can be refused before any work: options, the output directory and the
    draft's vocabulary against the target's (SpecError, exit 2)."""
    from batchspec.distill_train import check_vocabulary

    if opts.init not in ("draft", "target"):
        raise SpecError("--init", f"expected 'draft' or 'target', got {opts.init!r}")
    if opts.init == "draft" and not opts.draft:
        raise SpecError("--draft", "give the draft to start from, or --init target --layers N")
    for name, value in (("--sample", opts.sample), ("--steps", opts.steps),
                        ("--batch-size", opts.batch_size), ("--layers", opts.layers),
                        ("--chunk-rows", opts.chunk_rows)):
        if value < 1:
            raise SpecError(name, f"expected a positive integer, got {value}")
    if opts.heldout < 0 or opts.logprobs < 0:
        raise SpecError("--holdout" if opts.heldout < 0 else "--logprobs",
                        "expected zero or more")
    if not opts.lr > 0:
        raise SpecError("--lr", f"expected a positive learning rate, got {opts.lr}")
    check_out(spec, opts)
    if opts.draft:
        check_vocabulary(spec.model.target, opts.draft)


# --------------------------------------------------------------------------- one writer


def _private_dir(path: Path) -> None:
    """Make ``path`` a directory only this user can enter, or check that it is one: never a
    symbolic link someone planted, never another user's directory (SpecError naming --out)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                "not a directory" if not stat.S_ISDIR(st.st_mode) else "another user's")
        raise SpecError("--out", f"{path}, distill's work directory for this --out, is {what}: "
                                 "remove it or choose another --out")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class OutLock:
    """The one writer of an ``--out``: an flock on ``<work>/lock``, held for the whole distill.
    The kernel frees it when the holder dies (SIGKILL included); the file names the holder
    (host, pid, start time) for the refusal a second writer prints."""

    _held: list[OutLock] = []

    def __init__(self, path: Path, fd: int, record: dict):
        self.path, self.fd, self.record, self.pid = path, fd, record, os.getpid()

    @classmethod
    def take(cls, out: str | os.PathLike) -> OutLock:
        """Lock ``out`` for this process: RuntimeFailure (exit 1) naming the holder if another
        process has it; SpecError (exit 2) if the work directory or the lock file is a planted
        link or someone else's."""
        work = work_dir(out)
        work.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(work)
        path = work / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SpecError("--out", f"cannot open the lock file {path}: "
                                     f"{exc.strerror or exc} (a symbolic link?)") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise SpecError("--out", f"the lock file {path} is not a regular file of this "
                                         "user: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                raise RuntimeFailure(
                    f"--out {out}: another batchspec distill is writing this draft ("
                    + (f"host {holder.get('host')}, pid {holder.get('pid')}, started "
                       f"{holder.get('started_at')}" if holder else "holder not recorded yet")
                    + f"; lock {path}); wait for it to end or choose another --out") from None
            except OSError as exc:
                raise RuntimeFailure(f"cannot lock {path}: {exc} (the filesystem of --out must "
                                     "support flock)") from exc
            record = {"host": this_host(), "pid": os.getpid(),
                      "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd, record)
        cls._held.append(lock)
        return lock

    def release(self) -> None:
        """Forget the holder's record, then unlock (the file stays: nobody races on its name)."""
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.ftruncate(self.fd, 0)
            finally:
                os.close(self.fd)
        self.fd = -1
        if self in OutLock._held:
            OutLock._held.remove(self)

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    """The record in a lock file another process holds (it may be between flock and write)."""
    for attempt in range(5):
        try:
            data = os.pread(fd, 4096, 0)
            record = json.loads(data) if data.strip() else None
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            return record
        time.sleep(0.02 * (attempt + 1))
    return None


def _forget_locks_in_child() -> None:
    """A forked child (an engine process) drops its copy of the descriptor: the lock ends with
    the process that took it, not with the last of its children."""
    for lock in OutLock._held:
        if lock.fd >= 0:
            try:
                os.close(lock.fd)
            except OSError:
                pass
        lock.fd = -1
    OutLock._held.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


# --------------------------------------------------------------------------- the model directory


def _remove_leftovers(work: Path) -> None:
    """Drafts being built or replaced by a distill that died (only the lock holder calls this)."""
    for leftover in (*work.glob("model-*"), *work.glob("replaced-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def build_dir(out: str | os.PathLike) -> Path:
    """A new, empty directory in the work directory for the draft being built (same filesystem
    as ``--out``: it is renamed into place)."""
    path = work_dir(out) / f"model-{os.getpid()}-{os.urandom(6).hex()}"
    os.mkdir(path, 0o777)  # the umask's permissions, as a directory made by mkdir -p
    return path


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the kernel,
    libc or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def install(built: Path, out: str | os.PathLike, card: dict) -> None:
    """Make ``built`` the draft at ``out``: every file fsynced, then the card written (last,
    durably), then the directory renamed into place. A draft already at ``out`` is exchanged
    with the new one in one step where the kernel can, else moved aside first (``out`` is then
    missing for a moment, never half written); the old one is then deleted."""
    target = out_dir(out)
    _fsync_tree(built)
    tmp = built / f".{CARD_NAME}.tmp"
    tmp.write_text(json.dumps(card, indent=2) + "\n")
    replace_durably(str(tmp), str(built / CARD_NAME))
    work = built.parent
    if os.path.lexists(target):
        if _exchange(built, target):
            old = built  # the exchange left the previous draft at the build path
        else:
            old = work / f"replaced-{os.getpid()}-{os.urandom(6).hex()}"
            os.rename(target, old)
            os.rename(built, target)
    else:
        os.rename(built, target)
        old = None
    fsync_dir(str(target.parent))
    fsync_dir(str(work))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- the card


def _set_as_written(raw: dict, item: str) -> None:
    """Apply one ``--set KEY=VALUE`` without expanding ``${VAR}`` (the value as YAML)."""
    import yaml

    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        return
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return
        node = child
    node[parts[-1]] = parsed


def public_job(spec: JobSpec, job_path: str | None, overrides: tuple[str, ...] = ()) -> dict:
    """The job as written (``${VAR}`` kept, ``--set`` applied as given) in its public view
    (:func:`batchspec.redact.public_spec`: no secret, no URL userinfo or query). Without the
    file (a library call), the public view of the resolved spec."""
    import yaml

    raw = None
    if job_path:
        try:
            raw = yaml.safe_load(Path(job_path).read_text())
        except (OSError, yaml.YAMLError):
            raw = None
    if not isinstance(raw, dict):
        return public_spec(spec.raw)
    for item in overrides:
        _set_as_written(raw, item)
    return public_spec(raw)


def _public_path(value: str | None) -> str | None:
    return None if value is None else sanitize_url(str(value))


def build_card(spec: JobSpec, opts: DistillOptions, *, sample, gen, trained, layers: int,
               parameters: int, before: dict | None, after: dict | None, data_fingerprint: str,
               started: float) -> dict:
    """``batchspec-model.json``: what the draft is and how it was made, in the public view of the
    job (``${VAR}`` as written, no secret, URLs without userinfo or query)."""
    job = public_job(spec, opts.job_path, opts.overrides)
    model = job.get("model") if isinstance(job.get("model"), dict) else {}
    return {
        "role": "draft",
        "parent_draft": _public_path(opts.draft) if opts.init == "draft" else None,
        "init": opts.init,
        "layers": layers,
        "parameters": parameters,
        "target": model.get("target"),
        "job": {"name": job.get("name", spec.name), "path": _public_path(opts.job_path),
                "spec": job},
        "sample_size": len(sample.train),
        "heldout_size": len(sample.heldout),
        "population": sample.population,
        "steps": opts.steps,
        "lr": opts.lr,
        "batch_size": opts.batch_size,
        "seed": opts.seed,
        "logprobs": opts.logprobs,
        "sampling": job.get("sampling") or {},
        "data_fingerprint": data_fingerprint,
        "generation": {"generated_rows": gen.generated_rows, "reused_rows": gen.reused_rows,
                       "failed_rows": gen.failed_rows, "wall_s": round(gen.wall_s, 2)},
        "training": {"loss": trained.loss, "top1_agreement": trained.top1_agreement,
                     "wall_s": round(trained.wall_s, 2), "device": trained.device},
        "acceptance": {"before": before, "after": after},
        "wall_s": round(time.monotonic() - started, 2),
        "batchspec_version": __version__,
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }


# --------------------------------------------------------------------------- the whole run


def distill(spec: JobSpec, opts: DistillOptions,
            progress: Callable[[str], None] | None = None,
            lock: OutLock | None = None) -> DistillResult:
    """Run the whole distillation (see the module docstring) and return acceptance before and
    after, with the new draft and its card at ``opts.out``. ``lock``: the caller already
    checked the options and holds ``opts.out``'s lock (the command line does, to refuse before
    it redirects the logs); else both happen here."""
    own_lock = lock is None
    if own_lock:
        check_options(spec, opts)
        lock = OutLock.take(opts.out)
    try:
        return _distill(spec, opts, progress or (lambda msg: None))
    finally:
        if own_lock:
            lock.release()


def _distill(spec: JobSpec, opts: DistillOptions, say: Callable[[str], None]) -> DistillResult:
    from batchspec.distill_data import data_fingerprint, generate, generation_key, sample_rows
    from batchspec.distill_train import (
        draft_from_target,
        load_draft,
        save_draft,
        tokenizer_vocab,
        train_draft,
    )

    started = time.monotonic()
    out = out_dir(opts.out)
    work = work_dir(out)
    _remove_leftovers(work)

    sample = sample_rows(spec, opts.sample, opts.heldout, opts.seed)
    if not sample.train:
        raise InputDataError(", ".join(spec.input.paths),
                             "no prompts to sample: the input has no row that can be sent")
    say(f"sample: {len(sample.train)} prompts to train on, {len(sample.heldout)} held out "
        f"(of {sample.population}, seed {opts.seed})")
    key = generation_key(spec, sample.train, opts.logprobs)
    gen = generate(spec, sample.train, work / f"generated-{key}", opts.logprobs, say,
                   chunk_rows=opts.chunk_rows)
    examples = gen.table.to_pylist()
    if not examples:
        raise SpecError("input.path", "the target generated no usable continuation to train on")

    if opts.init == "target":
        say(f"new draft: the target's embeddings, first {opts.layers} layer(s) and head")
        draft = draft_from_target(spec.model.target, opts.layers)
    else:
        draft = load_draft(opts.draft)
    _, special = tokenizer_vocab(spec.model.target)
    pad_id = next((v for v in (special["pad"], special["eos"], 0) if v is not None), 0)
    trained = train_draft(draft, examples, opts.steps, opts.lr, opts.batch_size, opts.seed,
                          pad_id, progress=say)
    built = build_dir(out)
    try:
        save_draft(draft, spec.model.target, built)
        layers = draft.config.num_hidden_layers
        parameters = sum(p.numel() for p in draft.parameters())
        del draft
        say(f"built the new draft ({parameters / 1e6:.2f}M parameters, {layers} layers); it "
            f"replaces {opts.out} when distill ends")

        before = after = None
        if opts.evaluate and sample.heldout:
            k = opts.k or _job_k(spec)
            if opts.draft:
                before = evaluate(spec, opts.draft, sample.heldout, k, opts.eval_concurrency, say)
                before["draft"] = _public_path(opts.draft)
            after = evaluate(spec, str(built), sample.heldout, k, opts.eval_concurrency, say)
            after["draft"] = str(opts.out)  # where it is from now on

        card = build_card(spec, opts, sample=sample, gen=gen, trained=trained, layers=layers,
                          parameters=parameters, before=before, after=after,
                          data_fingerprint=data_fingerprint(gen.table), started=started)
        install(built, out, card)
    finally:
        if built.exists():
            shutil.rmtree(built, ignore_errors=True)
    say(f"the new draft is in {opts.out}")
    return DistillResult(out=str(opts.out), before=before, after=after, card=card)


def evaluate(spec: JobSpec, draft: str, rows: list[Row], k: int, concurrency: int | None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Acceptance and output tok/s of ``draft`` on ``rows`` with the job's sampling, speculation
    on (``draft_model``, ``k`` tokens): a fresh engine, shut down before this returns."""
    from batchspec.engine import Engine

    say = progress or (lambda msg: None)
    speculative = dict(spec.speculative or {})
    if speculative.get("method") not in (None, "draft_model"):
        speculative = {}  # the job's ngram/eagle keys mean nothing for a draft model
    speculative.update(method="draft_model", model=draft, num_speculative_tokens=k)
    eval_spec = dataclasses.replace(spec, speculative=speculative)
    say(f"evaluating {draft} on {len(rows)} held-out prompts (k={k})")
    engine = Engine(eval_spec)
    drafted = accepted = steps = tokens = errors = 0
    try:
        started = time.monotonic()
        for _, result in engine.stream(iter(rows), concurrency or spec.execution.max_in_flight):
            if result.get("error") is not None:
                errors += 1
                continue
            tokens += result["num_output_tokens"] or 0
            drafted += result.get("spec_num_draft_tokens") or 0
            accepted += result.get("spec_num_accepted_tokens") or 0
            steps += result.get("spec_num_steps") or 0
        wall = time.monotonic() - started
        counters = engine.spec_counters()
    finally:
        engine.shutdown()
    drafts = counters.get("spec_decode_num_drafts") or 0
    per_pos = counters.get("spec_decode_num_accepted_tokens_per_pos") or []
    result = {
        "draft": draft,
        "num_speculative_tokens": k,
        "prompts": len(rows) - errors,
        "errors": errors,
        "output_tokens": tokens,
        "acceptance_rate": _round(acceptance_rate(accepted, drafted)),
        "mean_acceptance_length": _round(mean_acceptance_length(accepted, steps)),
        "acceptance_per_position": [_round(acceptance_rate(a, drafts)) for a in per_pos],
        "output_tokens_per_s": _round(tokens / wall if wall > 0 else None, 1),
        "wall_s": round(wall, 2),
    }
    say(f"  acceptance {result['acceptance_rate']}, mean length "
        f"{result['mean_acceptance_length']}, {result['output_tokens_per_s']} tok/s")
    return result


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def render_table(result: DistillResult) -> str:
    """Before and after, side by side, for a terminal."""
    rows = [("acceptance rate", "acceptance_rate"),
            ("mean acceptance length", "mean_acceptance_length"),
            ("output tok/s", "output_tokens_per_s")]

    def cell(side: dict | None, key: str) -> str:
        if side is None or side.get(key) is None:
            return "-"
        return f"{side[key]:.3f}" if key != "output_tokens_per_s" else f"{side[key]:.1f}"

    lines = [f"{'':<26}{'before':>10}{'after':>10}"]
    for label, key in rows:
        lines.append(f"{label:<26}{cell(result.before, key):>10}{cell(result.after, key):>10}")
    width = max(len((result.before or {}).get("acceptance_per_position") or []),
                len((result.after or {}).get("acceptance_per_position") or []))
    for i in range(width):
        b = ((result.before or {}).get("acceptance_per_position") or [])
        a = ((result.after or {}).get("acceptance_per_position") or [])
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"{f'accepted at position {i + 1}':<26}"
                     f"{fmt(b[i] if i < len(b) else None):>10}{fmt(a[i] if i < len(a) else None):>10}")
    lines.append(f"new draft: {result.out}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line


@click.command("distill")
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key (dotted; value parsed as YAML). Repeatable.")
@click.option("--draft", type=click.Path(file_okay=False), default=None,
              help="The draft to start from (and to compare against); its tokenizer must be the "
                   "target's.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Directory for the new draft (weights, config, tokenizer, batchspec-model.json), "
                   "replaced whole when distill ends; .NAME.batchspec-distill/ beside it keeps "
                   "the generated data for a restart.")
@click.option("--init", type=click.Choice(["draft", "target"]), default="draft", show_default=True,
              help="draft: train --draft further; target: a new draft from the target's own "
                   "embeddings, first --layers layers and head.")
@click.option("--layers", type=int, default=1, show_default=True,
              help="Layers of the new draft with --init target.")
@click.option("--sample", type=int, default=2000, show_default=True,
              help="Prompts drawn from the job's input (seeded), held-out ones included.")
@click.option("--holdout", "heldout", type=int, default=200, show_default=True,
              help="Prompts of the sample kept for evaluation (at most half of it).")
@click.option("--logprobs", type=int, default=0, show_default=True, metavar="K",
              help="Keep the target's top-K log-probabilities per token and add a KL term.")
@click.option("--steps", type=int, default=300, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the sample, the split and the training.")
@click.option("--k", type=int, default=None,
              help="Speculative tokens per step in the evaluation (default: the job's, else 4).")
@click.option("--eval-concurrency", type=int, default=None,
              help="Requests in flight in the evaluation (default: execution.max_in_flight).")
@click.option("--eval/--no-eval", "evaluate_", default=True, show_default=True,
              help="Measure acceptance before and after on the held-out prompts.")
@click.option("--chunk-rows", type=int, default=128, show_default=True,
              help="Generated rows per committed chunk: a killed run loses at most this many.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {before, after, out} as one JSON object on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show vLLM's own logs.")
def distill_command(job, overrides, draft, out, init, layers, sample, heldout, logprobs, steps, lr,
                    batch_size, seed, k, eval_concurrency, evaluate_, chunk_rows, as_json, verbose):
    """Fine-tune a draft on the target's own outputs for JOB's prompts, and measure acceptance
    before and after on held-out prompts."""
    import os

    from batchspec.cli import _engine_log, _fail, _load, _quiet_vllm
    from batchspec.runner import new_run_id

    _quiet_vllm(verbose)
    spec = _load(job, overrides)
    opts = DistillOptions(out=Path(out), draft=draft, init=init, layers=layers, sample=sample,
                          heldout=heldout, logprobs=logprobs, steps=steps, lr=lr,
                          batch_size=batch_size, seed=seed, k=k, eval_concurrency=eval_concurrency,
                          evaluate=evaluate_, chunk_rows=chunk_rows, job_path=job,
                          overrides=tuple(overrides))
    try:
        # before the log redirection: refusals reach the terminal as is, before any engine
        check_options(spec, opts)
        lock = OutLock.take(opts.out)
    except Exception as exc:
        _fail(exc)
    # stdout carries the result only: vLLM's processes and torch write to the engine log
    stdout = os.fdopen(os.dup(1), "w", buffering=1)
    stream = sys.stderr
    if not verbose:
        stream, engine_log = _engine_log(new_run_id())
        print(f"batchspec distill: vLLM's own output goes to {engine_log} (-v shows it here)",
              file=stream)

    def progress(msg: str) -> None:
        print(f"batchspec distill: {msg}", file=stream, flush=True)

    try:
        result = distill(spec, opts, progress, lock=lock)
    except KeyboardInterrupt:
        print("batchspec: interrupted", file=stream)
        sys.exit(130)
    except Exception as exc:
        sys.stderr = stream  # _fail reports on stderr: the terminal's, not the engine log
        _fail(exc)
    finally:
        lock.release()
    if as_json:
        stdout.write(json.dumps(result.as_json()) + "\n")
    else:
        stdout.write(render_table(result))
    stdout.flush()
