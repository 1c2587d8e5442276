"""``batchspec distill``: fit a draft to the job's own prompts.

1. a seeded sample of the job's prompts, part of it held out (:mod:`batchspec.distill_data`);
2. the target's continuations of the rest, speculation off, the job's sampling, resumable;
3. training with torch (:mod:`batchspec.distill_train`);
4. a model directory vLLM loads as a draft, with its card ``batchspec-model.json``;
5. evaluation on the held-out prompts with speculation on, the old draft and the new.

One vLLM engine at a time: each is shut down before the next starts. The vocabulary check runs
before any of it, so a draft that cannot work exits 2 before any work.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from batchspec import __version__
from batchspec.errors import InputDataError, SpecError
from batchspec.prompts import Row
from batchspec.spec import JobSpec
from batchspec.stats import acceptance_rate, mean_acceptance_length

CARD_NAME = "batchspec-model.json"
WORK_DIR = "_work"
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
    out = opts.out.resolve()
    for name, path in (("--draft", opts.draft), ("model.target", spec.model.target)):
        if path and Path(path).exists() and Path(path).resolve() == out:
            raise SpecError("--out", f"{opts.out} is {name}: write the new draft elsewhere")
    if out.exists() and not out.is_dir():
        raise SpecError("--out", f"{opts.out} exists and is not a directory")
    if opts.draft:
        check_vocabulary(spec.model.target, opts.draft)


def distill(spec: JobSpec, opts: DistillOptions,
            progress: Callable[[str], None] | None = None) -> DistillResult:
    """Run the whole distillation (see the module docstring) and return acceptance before and
    after with the card written into ``opts.out``."""
    from batchspec.distill_data import data_fingerprint, generate, generation_key, sample_rows
    from batchspec.distill_train import (
        draft_from_target,
        load_draft,
        save_draft,
        tokenizer_vocab,
        train_draft,
    )

    say = progress or (lambda msg: None)
    started = time.monotonic()
    check_options(spec, opts)
    out = opts.out
    work = out / WORK_DIR

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

    # the card of an earlier run in this folder describes other weights: gone until ours is done
    (out / CARD_NAME).unlink(missing_ok=True)
    if opts.init == "target":
        say(f"new draft: the target's embeddings, first {opts.layers} layer(s) and head")
        draft = draft_from_target(spec.model.target, opts.layers)
    else:
        draft = load_draft(opts.draft)
    _, special = tokenizer_vocab(spec.model.target)
    pad_id = next((v for v in (special["pad"], special["eos"], 0) if v is not None), 0)
    trained = train_draft(draft, examples, opts.steps, opts.lr, opts.batch_size, opts.seed,
                          pad_id, progress=say)
    save_draft(draft, spec.model.target, out)
    layers = draft.config.num_hidden_layers
    parameters = sum(p.numel() for p in draft.parameters())
    del draft
    say(f"saved the new draft to {out} ({parameters / 1e6:.2f}M parameters, {layers} layers)")

    before = after = None
    if opts.evaluate and sample.heldout:
        k = opts.k or _job_k(spec)
        if opts.draft:
            before = evaluate(spec, opts.draft, sample.heldout, k, opts.eval_concurrency, say)
        after = evaluate(spec, str(out), sample.heldout, k, opts.eval_concurrency, say)

    card = {
        "role": "draft",
        "parent_draft": opts.draft if opts.init == "draft" else None,
        "init": opts.init,
        "layers": layers,
        "parameters": parameters,
        "target": spec.model.target,
        "job": {"name": spec.name, "path": opts.job_path},
        "sample_size": len(sample.train),
        "heldout_size": len(sample.heldout),
        "population": sample.population,
        "steps": opts.steps,
        "lr": opts.lr,
        "batch_size": opts.batch_size,
        "seed": opts.seed,
        "logprobs": opts.logprobs,
        "sampling": spec.sampling,
        "data_fingerprint": data_fingerprint(gen.table),
        "generation": {"generated_rows": gen.generated_rows, "reused_rows": gen.reused_rows,
                       "failed_rows": gen.failed_rows, "wall_s": round(gen.wall_s, 2)},
        "training": {"loss": trained.loss, "top1_agreement": trained.top1_agreement,
                     "wall_s": round(trained.wall_s, 2), "device": trained.device},
        "acceptance": {"before": before, "after": after},
        "wall_s": round(time.monotonic() - started, 2),
        "batchspec_version": __version__,
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    (out / CARD_NAME).write_text(json.dumps(card, indent=2) + "\n")
    return DistillResult(out=str(out), before=before, after=after, card=card)


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
              help="Directory for the new draft (weights, config, tokenizer, batchspec-model.json); "
                   "its _work/ folder keeps the generated data for a restart.")
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
                          evaluate=evaluate_, chunk_rows=chunk_rows, job_path=job)
    try:
        check_options(spec, opts)  # before the log redirection: errors reach the terminal as is
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
        result = distill(spec, opts, progress)
    except KeyboardInterrupt:
        print("batchspec: interrupted", file=stream)
        sys.exit(130)
    except Exception as exc:
        sys.stderr = stream  # _fail reports on stderr: the terminal's, not the engine log
        _fail(exc)
    if as_json:
        stdout.write(json.dumps(result.as_json()) + "\n")
    else:
        stdout.write(render_table(result))
    stdout.flush()
