"""``batchspec distill``: fit a draft to the job's own prompts.

1. a seeded sample of the job's prompts, part of it held out, part kept for validation
   (:mod:`batchspec.distill.data`);
2. the target's continuations of the training and validation prompts, as long as the sizing
   rule asks (:func:`~batchspec.distill.data.plan_data`), speculation off, the job's sampling,
   resumable;
3. training with torch, stopped when validation agreement stops rising, the best weights kept
   (:mod:`batchspec.distill.train`);
4. a model directory vLLM loads as a draft, built aside;
5. evaluation on the held-out prompts with speculation on, the old draft and the new, and the
   install decision (:mod:`batchspec.distill.gate`): a new draft that does not beat the old one
   by more than the noise is not installed (NotInstalled, exit 4) unless ``force``;
6. the card ``batchspec-model.json`` written last into the new directory, which is then renamed
   into place as ``--out`` (a previous draft there is swapped out atomically where the kernel can
   exchange two directories, else moved aside first): ``--out`` is always either a whole draft
   with its card or no draft at all.

One writer per ``--out``: an flock on ``<work>/lock``, where ``<work>`` is the private directory
``.<name>.batchspec-distill`` beside ``--out`` (generated data, the draft being built); the kernel
frees it when its holder dies, and a second distill exits 1 naming the holder.

One vLLM engine at a time: each is shut down before the next starts. Every refusal (options,
``--out`` overlapping the job's input, output, target or draft, the vocabulary check) comes
before any of it, so a distill that cannot work exits 2 before any work."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from batchspec.distill.card import build_card, public_path
from batchspec.distill.options import DistillOptions, DistillResult, job_k
from batchspec.distill.outdir import (
    CARD_NAME,
    OutLock,
    build_dir,
    install,
    out_dir,
    remove_leftovers,
    work_dir,
)
from batchspec.errors import InputDataError, NotInstalled, SpecError
from batchspec.io.locations import location_overlap, store_location
from batchspec.io.reader import Row
from batchspec.redact import sanitize_url
from batchspec.spec.methods import DRAFT_MODEL, METHODS, TRAINABLE
from batchspec.spec.model import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length, request_totals

if TYPE_CHECKING:  # data imports pyarrow; the run imports it when it runs
    from batchspec.distill.data import Sample


def _overlap(
    out: Path,
    out_loc,
    url: str,
    options: dict,
    key: str,
    what: str,
    pattern: bool = False,
    local_only: bool = False,
) -> None:
    """SpecError("--out") when ``--out`` equals, lies inside or contains ``url``, judged by
    batchspec.io.output_dir' own rules (:func:`~batchspec.io.locations.store_location`,
    :func:`~batchspec.io.locations.location_overlap`: what a location names, not how it is spelled)."""
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
        raise SpecError(
            "--out",
            f"{out} {where} {what} ({sanitize_url(url)}): distill would "
            "write over or into it; write the new draft elsewhere",
        )


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
        _overlap(
            out,
            out_loc,
            url,
            spec.input.storage_options,
            "input.path",
            "the job's input location",
            pattern=True,
        )
    _overlap(
        out, out_loc, spec.output.path, spec.output.storage_options, "output.path", "the job's output.path"
    )
    _overlap(
        out,
        out_loc,
        spec.model.target,
        {},
        "model.target",
        "the job's target (model.target)",
        local_only=True,
    )
    if opts.draft:
        _overlap(out, out_loc, str(opts.draft), {}, "--draft", "the current draft (--draft)", local_only=True)
    if opts.head:
        _overlap(out, out_loc, str(opts.head), {}, "--head", "the current head (--head)", local_only=True)
    spec_draft = (spec.speculative or {}).get("model")
    if isinstance(spec_draft, str):
        _overlap(
            out,
            out_loc,
            spec_draft,
            {},
            "speculative.model",
            "the job's draft (speculative.model)",
            local_only=True,
        )
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SpecError("--out", f"{opts.out} is a symbolic link: name the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError("--out", f"{opts.out} exists and is not a directory")
    if any(out.iterdir()) and not (out / CARD_NAME).is_file():
        raise SpecError(
            "--out",
            f"{opts.out} exists, is not empty and holds no {CARD_NAME} (it "
            "is not a draft batchspec wrote): distill replaces its --out "
            "whole; choose an empty or new directory",
        )


def check_options(spec: JobSpec, opts: DistillOptions) -> None:
    """Everything that can be refused before any work: options, the output directory and the
    draft's vocabulary against the target's (SpecError, exit 2)."""
    from batchspec.distill.device import resolve as resolve_device
    from batchspec.distill.train import check_vocabulary
    from batchspec.tasks import refuse_speculation_tools

    refused = refuse_speculation_tools(spec.task, "batchspec distill")
    if refused is not None:
        raise SpecError("task", refused)
    if spec.input.image_columns:  # a drafter trains on token ids: it would never see the images
        raise SpecError(
            "input.image_columns",
            "batchspec distill trains drafters on text; a job whose rows carry images is not one "
            "it trains on (n-gram speculation needs no training: docs/images.md)",
        )
    if opts.method not in TRAINABLE:
        raise SpecError("--method", f"expected {' or '.join(map(repr, TRAINABLE))}, got {opts.method!r}")
    if opts.init not in ("draft", "target"):
        raise SpecError("--init", f"expected 'draft' or 'target', got {opts.init!r}")
    METHODS[opts.method].trainer().check(spec, opts)
    if opts.device != "auto":  # auto needs no check (nor torch): it takes what there is
        resolve_device(opts.device)
    if opts.max_minutes is not None and not opts.max_minutes > 0:
        raise SpecError("--max-minutes", f"expected minutes > 0, got {opts.max_minutes}")
    for name, value in (
        ("--sample", opts.sample),
        ("--steps", opts.steps),
        ("--batch-size", opts.batch_size),
        ("--layers", opts.layers),
        ("--chunk-rows", opts.chunk_rows),
    ):
        if value < 1:
            raise SpecError(name, f"expected a positive integer, got {value}")
    if opts.patience < 1:
        raise SpecError("--patience", f"expected a positive integer, got {opts.patience}")
    for name, value in (
        ("--holdout", opts.heldout),
        ("--logprobs", opts.logprobs),
        ("--validation", opts.validation),
    ):
        if value is not None and value < 0:
            raise SpecError(name, "expected zero or more")
    if opts.start and not opts.force and (not opts.evaluate or opts.heldout == 0):
        raise SpecError(
            "--no-eval" if not opts.evaluate else "--holdout",
            f"a new drafter replaces {opts.start_key} only when it beats it on held-out prompts, and "
            + ("--no-eval" if not opts.evaluate else "--holdout 0")
            + " leaves nothing to compare: give --force to install without the comparison",
        )
    if not opts.lr > 0:
        raise SpecError("--lr", f"expected a positive learning rate, got {opts.lr}")
    check_out(spec, opts)
    if opts.draft:
        check_vocabulary(spec.model.target, opts.draft)


# --------------------------------------------------------------------------- the whole run


def too_little_data(tokens: int, prompts: int, wanted: int, window: int, sample: Sample, asked: int) -> str:
    """What distill says when the target's tokens to train on fall short of what the drafter
    wants: the numbers, and whether more ``--sample`` or only a larger job would give more."""
    per_prompt = max(1, tokens // max(1, prompts))
    needed = -(-wanted // per_prompt)
    have = f"{tokens} target tokens to train on ({prompts} prompts x about {per_prompt})"
    want = f"the drafter wants {wanted}, about {needed} prompts of this job's {window}-token outputs"
    if sample.population < asked:
        return (
            f"{have}: {want}, and the job has {sample.population} prompts in all "
            f"({len(sample.heldout)} held out to judge the result): training on what there is; "
            "the held-out comparison decides whether it is installed"
        )
    return f"{have}: {want}; more prompts (--sample, up to the job's {sample.population}) would help"


def distill(
    spec: JobSpec,
    opts: DistillOptions,
    progress: Callable[[str], None] | None = None,
    lock: OutLock | None = None,
) -> DistillResult:
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
    from batchspec.distill.data import (
        MAX_EPOCHS,
        PARAMS_PER_TOKEN,
        data_fingerprint,
        draw_sample,
        generate,
        generation_key,
        job_window,
        plan_data,
        split_validation,
        supported_steps,
        validation_size,
    )
    from batchspec.distill.gate import decide

    started = time.monotonic()
    out = out_dir(opts.out)
    work = work_dir(out)
    remove_leftovers(work)
    baseline = bool(opts.start)  # the drafter a new one must beat
    deadline = None if opts.max_minutes is None else started + 60 * opts.max_minutes

    sample = draw_sample(spec, opts.sample, opts.heldout, opts.seed)
    if not sample.train:
        raise InputDataError(
            ", ".join(spec.input.paths), "no prompts to sample: the input has no row that can be sent"
        )
    if baseline and not opts.force and opts.evaluate and not sample.heldout:
        raise SpecError(
            "--holdout",
            f"the input has {sample.population} prompt(s): too few to hold any out, and a new "
            "drafter replaces --draft only when it beats it on held-out prompts (--force installs "
            "without the comparison)",
        )
    sample = split_validation(
        sample, validation_size(len(sample.train)) if opts.validation is None else opts.validation
    )
    say(
        f"sample: {len(sample.train)} prompts to train on, {len(sample.validation)} to validate the "
        f"training, {len(sample.heldout)} held out (of {sample.population}, seed {opts.seed})"
    )

    # the model first: its size is part of how much data it needs
    trainer = METHODS[opts.method].trainer()
    draft = trainer.start(spec, opts, say)
    parameters = sum(p.numel() for p in draft.parameters())
    window = job_window(spec)
    plan = plan_data(
        opts.steps, opts.batch_size, window, len(sample.train), parameters, trainer.max_windows(opts)
    )
    say(
        f"data: {plan.wanted_tokens} target tokens wanted (the larger of steps x batch x "
        f"{window} / {MAX_EPOCHS} and {parameters} parameters / {PARAMS_PER_TOKEN}): "
        f"{plan.windows} window(s) of {window} tokens per prompt"
    )
    rows = [*sample.train, *sample.validation]
    key = generation_key(spec, rows, opts.logprobs, plan.windows)
    gen = generate(
        spec,
        rows,
        work / f"generated-{key}",
        opts.logprobs,
        say,
        chunk_rows=opts.chunk_rows,
        windows=plan.windows,
    )
    held_ids = {r.request_id for r in sample.validation}
    generated = gen.table.to_pylist()
    examples = [r for r in generated if r["request_id"] not in held_ids]
    validation = [r for r in generated if r["request_id"] in held_ids]
    if not examples:
        raise SpecError("input.path", "the target generated no usable continuation to train on")
    tokens = sum(len(r["output_token_ids"]) for r in examples)
    windows = sum(-(-len(r["output_token_ids"]) // window) for r in examples)
    steps = supported_steps(windows, opts.batch_size, opts.steps)
    if steps < opts.steps:
        say(
            f"the data ({tokens} tokens in {windows} windows) supports {steps} steps of "
            f"{opts.batch_size} at most {MAX_EPOCHS} passes over each window: training {steps} "
            f"of the {opts.steps} asked (--sample more prompts for more)"
        )
    if tokens < plan.wanted_tokens:
        say(too_little_data(tokens, len(examples), plan.wanted_tokens, window, sample, opts.sample))
    data = {**plan.as_json(), "train_tokens": tokens, "train_windows": windows, "steps_supported": steps}

    trained = trainer.train(
        spec,
        opts,
        draft,
        examples,
        validation,
        steps,
        window=window,
        features=work / f"features-{key}",
        say=say,
        deadline=deadline,
    )
    if baseline and opts.init == "draft" and trained.best_step == 0 and not opts.force:
        decision = decide(None, None, force=False)
        decision.reason = (
            f"training never raised the validation figure ({trained.metric}) above the starting "
            f"draft's ({trained.start_validation_agreement}): the new drafter would be the old one"
        )
        result = DistillResult(out=str(opts.out), before=None, after=None, decision=decision.as_json())
        raise NotInstalled(_refusal(opts, decision), result)
    built = build_dir(out)
    try:
        layers = trainer.save(draft, spec, built, parameters, say)
        del draft

        before = after = None
        before_counts = after_counts = None
        if opts.evaluate and sample.heldout:
            k = opts.k or job_k(spec)
            if opts.start:
                before_counts = {}
                before = evaluate(
                    spec,
                    trainer.baseline(spec, opts, work, say),
                    sample.heldout,
                    k,
                    opts.eval_concurrency,
                    say,
                    counts=before_counts,
                    method=opts.method,
                )
                before["draft"] = public_path(opts.start)
            after_counts = {}
            after = evaluate(
                spec,
                str(built),
                sample.heldout,
                k,
                opts.eval_concurrency,
                say,
                counts=after_counts,
                method=opts.method,
            )
            after["draft"] = str(opts.out)  # where it is from now on
        decision = decide(before_counts, after_counts, opts.force, baseline=baseline)
        say(f"{'installing' if decision.install else 'not installing'}: {decision.reason}")
        if not decision.install:
            if after is not None:
                after["draft"] = None  # never installed
            result = DistillResult(out=str(opts.out), before=before, after=after, decision=decision.as_json())
            raise NotInstalled(_refusal(opts, decision), result)

        card = build_card(
            spec,
            opts,
            sample=sample,
            gen=gen,
            trained=trained,
            layers=layers,
            parameters=parameters,
            before=before,
            after=after,
            data_fingerprint=data_fingerprint(_train_table(gen.table, held_ids)),
            started=started,
            data=data,
            decision=decision.as_json(),
        )
        install(built, out, card)
    finally:
        if built.exists():
            shutil.rmtree(built, ignore_errors=True)
    say(f"the new {METHODS[opts.method].role} is in {opts.out}")
    return DistillResult(
        out=str(opts.out), before=before, after=after, card=card, decision=decision.as_json()
    )


def _train_table(table, held_ids: set[str]):
    """The generated rows trained on (the validation rows left out)."""
    import pyarrow as pa

    ids = table.column("request_id").to_pylist()
    return table.take(pa.array([i for i, rid in enumerate(ids) if rid not in held_ids], pa.int64()))


def _refusal(opts: DistillOptions, decision) -> str:
    where = f"{opts.out} was left as it was" if os.path.lexists(opts.out) else f"{opts.out} was not created"
    return (
        f"the new drafter was not installed: {decision.reason}; the starting drafter "
        f"{public_path(opts.start)} stays, {where} (--force installs anyway)"
    )


def evaluate(
    spec: JobSpec,
    draft: str,
    rows: list[Row],
    k: int,
    concurrency: int | None,
    progress: Callable[[str], None] | None = None,
    counts: dict | None = None,
    method: str = DRAFT_MODEL.name,
) -> dict:
    """Acceptance and output tok/s of ``draft`` on ``rows`` with the job's sampling, speculation
    on (``draft_model``, ``k`` tokens): a fresh engine, shut down before this returns.
    ``counts``, where given, is filled with each answered row's (accepted, drafted) tokens by
    request id (what :func:`batchspec.distill.gate.decide` compares)."""
    from batchspec.engine.llm import Engine

    say = progress or (lambda msg: None)
    speculative = dict(spec.speculative or {})
    if speculative.get("method") != method:
        speculative = {}  # another method's keys mean nothing for this drafter
    speculative.update(method=method, model=draft, num_speculative_tokens=k)
    eval_spec = dataclasses.replace(spec, speculative=speculative)
    say(f"evaluating {draft} on {len(rows)} held-out prompts (k={k})")
    engine = Engine(eval_spec)
    drafted = accepted = steps = tokens = errors = 0
    try:
        started = time.monotonic()
        for row, samples in engine.stream(iter(rows), concurrency or spec.execution.max_in_flight):
            result = request_totals(samples)
            if result.get("error") is not None:
                errors += 1
                continue
            tokens += result["num_output_tokens"] or 0
            row_drafted = result.get("spec_num_draft_tokens") or 0
            row_accepted = result.get("spec_num_accepted_tokens") or 0
            drafted += row_drafted
            accepted += row_accepted
            if counts is not None:
                counts[row.request_id] = (row_accepted, row_drafted)
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
    say(
        f"  acceptance {result['acceptance_rate']}, mean length "
        f"{result['mean_acceptance_length']}, {result['output_tokens_per_s']} tok/s"
    )
    return result


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def render_table(result: DistillResult) -> str:
    """Before and after, side by side, for a terminal."""
    rows = [
        ("acceptance rate", "acceptance_rate"),
        ("mean acceptance length", "mean_acceptance_length"),
        ("output tok/s", "output_tokens_per_s"),
    ]

    def cell(side: dict | None, key: str) -> str:
        if side is None or side.get(key) is None:
            return "-"
        return f"{side[key]:.3f}" if key != "output_tokens_per_s" else f"{side[key]:.1f}"

    lines = [f"{'':<26}{'before':>10}{'after':>10}"]
    for label, key in rows:
        lines.append(f"{label:<26}{cell(result.before, key):>10}{cell(result.after, key):>10}")
    width = max(
        len((result.before or {}).get("acceptance_per_position") or []),
        len((result.after or {}).get("acceptance_per_position") or []),
    )
    for i in range(width):
        b = (result.before or {}).get("acceptance_per_position") or []
        a = (result.after or {}).get("acceptance_per_position") or []
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(
            f"{f'accepted at position {i + 1}':<26}"
            f"{fmt(b[i] if i < len(b) else None):>10}{fmt(a[i] if i < len(a) else None):>10}"
        )
    decision = result.decision or {}
    if decision.get("gain") is not None:
        margin = decision.get("margin")
        lines.append(
            f"{'gain in acceptance rate':<26}{decision['gain']:>+10.4f}"
            + (
                f"  (must exceed {margin:.4f}: the noise over {decision['prompts']} prompts)"
                if margin
                else ""
            )
        )
    if decision.get("install", True):
        forced = " (--force)" if decision.get("forced") else ""
        lines.append(f"new draft: {result.out}{forced}")
    else:
        lines.append(f"not installed: {decision.get('reason')}")
    return "\n".join(lines) + "\n"
