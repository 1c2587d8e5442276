"""Which candidates tune measures: speculation off, each draft at each k, n-gram; and the job spec
each one runs with."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from batchspec.redact import sanitize_url
from batchspec.spec.build import build_spec
from batchspec.spec.checkpoints import method_of
from batchspec.spec.methods import NGRAM, family_label
from batchspec.spec.methods import method as method_named
from batchspec.spec.model import JobSpec
from batchspec.tune.model import (
    NGRAM_BASE,
    NGRAM_K,
    Candidate,
)


def draft_label(model: str, taken: set[str]) -> str:
    """A short name for a draft, never holding a credential: its directory name, the whole
    path where two share one, numbered where even that is taken. URLs pass through the
    sanitiser ``run`` uses (no ``user:password@``, no query such as ``?sig=``)."""
    shown = sanitize_url(str(model)).rstrip("/") or sanitize_url(str(model))
    reserved = {"off", NGRAM.name, *taken}
    name = Path(shown).name or shown
    if name in reserved:
        name = shown
    return _unique(name, reserved)


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 2
    while out in taken:
        out, n = f"{name} ({n})", n + 1
    return out


def candidates(
    spec: JobSpec, drafts: list[str], ks: list[int], ngram: bool
) -> tuple[list[Candidate], dict[str, list[Candidate]]]:
    """(fixed candidates: off then n-gram, draft families: label -> candidates by k).

    The job's own speculative config is a family (its other keys kept, only k varies); each
    ``--draft`` adds a family with the method its checkpoint calls for (``draft_model``,
    ``pard`` for a parallel draft, ``eagle3``/``eagle`` for a head, ``peagle`` for a parallel
    head: batchspec.spec.checkpoints), and a parallel drafter a second one drafting a token a
    pass (``draft_model``, ``eagle3``), so that tune weighs both ways of running it."""
    fixed = [Candidate("off", None, "off")]
    job = dict(spec.speculative) if spec.speculative else None
    job_ngram = bool(job) and job.get("method") == NGRAM.name
    if ngram or job_ngram:
        base = job if job_ngram else NGRAM_BASE
        ngram_ks = sorted(
            set(NGRAM_K)
            | ({job["num_speculative_tokens"]} if base is job and "num_speculative_tokens" in job else set())
        )
        for k in ngram_ks:
            fixed.append(
                Candidate(
                    f"{NGRAM.name} k={k}",
                    {**base, "num_speculative_tokens": k},
                    NGRAM.name,
                    k,
                    from_job=base is job,
                )
            )
    bases: list[dict] = []
    if job and not job_ngram:
        bases.append(job)
    for path in drafts:
        if any(b.get("model") == path for b in bases):
            continue
        # a head or a draft model: what its checkpoint's config says, never its name
        bases.append({"method": method_of(path), "model": path})
    for base in list(bases):
        # a parallel drafter (a draft or a head) drafts a token a pass too: weighed so beside
        sequential = getattr(method_named(base.get("method")), "sequential", None)
        if sequential:
            bases.insert(bases.index(base) + 1, {"method": sequential, "model": base.get("model")})
    families: dict[str, list[Candidate]] = {}
    for base in bases:
        name = draft_label(base.get("model") or base.get("method", "draft"), set(families))
        labelled = family_label(base.get("method"), name, bool(base.get("model")))
        if labelled != name:
            name = _unique(labelled, set(families))
        families[name] = [
            Candidate(f"{name} k={k}", {**base, "num_speculative_tokens": k}, name, k, from_job=base is job)
            for k in sorted(set(ks))
        ]
    return fixed, families


def candidate_spec(
    spec: JobSpec, speculative: dict | None, max_num_seqs: int, max_num_batched_tokens: int | None = None
) -> JobSpec:
    """The job with another speculative section and ``max_num_seqs`` (one engine per config),
    and ``max_num_batched_tokens`` where given (else the job's, or vLLM's default)."""
    raw = copy.deepcopy(spec.raw)
    raw["speculative"] = copy.deepcopy(speculative)
    model = raw.setdefault("model", {})
    engine = {**(model.get("engine") or {}), "max_num_seqs": max_num_seqs}
    if max_num_batched_tokens is not None:
        engine["max_num_batched_tokens"] = max_num_batched_tokens
    model["engine"] = engine
    return build_spec(raw)


def missing_local_draft(speculative: dict | None) -> str | None:
    """A reason to skip a draft given as a local path that does not exist (vLLM would otherwise
    try it as a model hub id)."""
    model = (speculative or {}).get("model")
    if not model or "://" in str(model):
        return None
    text = str(model)
    looks_local = text.startswith((".", "/", "~")) or os.sep in text and text.count("/") != 1
    if looks_local and not Path(text).expanduser().exists():
        return f"draft model {text!r}: no such directory"
    return None
