"""A job's ``speculative`` section: vLLM's ``speculative_config`` as the job gives it, with
batchspec's names for what runs (the method a checkpoint calls for, a parallel drafter in
vLLM's spelling, a method refused before any work: :mod:`batchspec.spec.methods`), or
``speculative: auto`` and its keys."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchspec.errors import SpecError
from batchspec.spec.checkpoints import method_of
from batchspec.spec.fields import Fields, kind_of
from batchspec.spec.methods import METHODS, REFUSED, parallel_form
from batchspec.spec.model import AutoSpeculation


def speculative_section(raw: dict) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` as the job gives it (checked against vLLM later), with the
    seed's shorthand (a draft model and no method) made explicit."""
    speculative = raw.get("speculative")
    if speculative is None:
        return None
    if not isinstance(speculative, dict):
        raise SpecError("speculative", f"expected a mapping, auto or null, got {kind_of(speculative)}")
    speculative = dict(speculative)
    if not speculative.get("method") and not speculative.get("model"):
        raise SpecError(
            "speculative.method", "give a method (draft_model, ngram, eagle, ...) or a draft model"
        )
    if speculative.get("model") and not speculative.get("method"):
        # what the checkpoint's config says it is (a head, a draft model or a parallel one), never
        # its name
        speculative["method"] = method_of(speculative["model"])
    refused = REFUSED.get(speculative.get("method")) if isinstance(speculative.get("method"), str) else None
    if refused:
        raise SpecError("speculative.method", f"{speculative['method']}: {refused}")
    parallel = parallel_form(speculative.get("method"), speculative)
    if parallel is not None:
        # vLLM's way of saying a parallel drafter: batchspec's name for it (vllm_speculative turns
        # it back), so that checks, labels and records say what runs
        for key, _ in METHODS[parallel].vllm_keys:
            del speculative[key]
        speculative["method"] = parallel
    return speculative


def is_auto(raw: dict) -> bool:
    """The job's section is ``speculative: auto`` in either form."""
    value = raw.get("speculative")
    return value == "auto" or isinstance(value, dict) and value.get("method") == "auto"


def auto_speculation(raw: dict) -> AutoSpeculation | None:
    """``speculative: auto`` (off and the methods that need no draft model) or ``speculative:
    {method: auto, drafts: [...], k: [...], ...}``; None for any other section."""
    if not is_auto(raw):
        return None
    if raw["speculative"] == "auto":
        return AutoSpeculation()
    auto = Fields(
        raw,
        "speculative",
        AutoSpeculation,
        required=True,
        keys=["method", *(f.name for f in dataclasses.fields(AutoSpeculation))],
    )
    drafts = auto.get("drafts", list)
    if any(not isinstance(d, str) or not d.strip() for d in drafts):
        raise SpecError("speculative.drafts", f"expected a list of draft model paths or ids, got {drafts!r}")
    k = positive_ints(auto, "k")
    if not k:
        raise SpecError("speculative.k", "expected at least one num_speculative_tokens")
    concurrency = positive_ints(auto, "concurrency") if auto.values.get("concurrency") is not None else None
    ngram = auto.get("ngram", bool)
    if not drafts and not ngram:
        raise SpecError(
            "speculative.drafts",
            "auto with ngram: false and no drafts has nothing to try beside speculation off",
        )
    max_minutes = auto.get("max_minutes", (int, float))
    if isinstance(max_minutes, bool) or max_minutes <= 0:
        raise SpecError("speculative.max_minutes", f"expected minutes > 0, got {max_minutes!r}")
    seed = auto.get("seed", int)
    if isinstance(seed, bool):
        raise SpecError("speculative.seed", f"expected an integer, got {seed!r}")
    return AutoSpeculation(
        drafts=tuple(drafts),
        k=tuple(sorted(set(k))),
        ngram=ngram,
        sample=auto.positive("sample"),
        seed=seed,
        concurrency=None if concurrency is None else tuple(sorted(set(concurrency))),
        max_minutes=float(max_minutes),
        remeasure=auto.get("remeasure", bool),
        batch_knobs=auto.get("batch_knobs", bool),
    )


def positive_ints(fields: Fields, key: str) -> list[int]:
    """A key holding a positive integer or a list of them, as a list."""
    value = fields.get(key, (list, tuple, int))
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise SpecError(f"{fields.name}.{key}", f"expected positive integers, got {value!r}")
    return values
