"""The speculative methods batchspec knows, one :class:`Method` each, in :data:`METHODS`.

A method's object holds what batchspec itself knows of it (vLLM runs it; batchspec checks,
labels, records and trains it):

- how a checkpoint's ``config.json`` names it (:func:`detect`: speculators' algorithm name, an
  architecture's name, a ``model_type``);
- the checks made before weights load: what its model is (``role``: a draft model of its own, a
  head on the target's hidden states, or none), whether its auxiliary layers are checked against
  the target's, a package vLLM imports for it (:class:`Package`);
- ``tune``'s label for a family of its candidates (:func:`family_label`) and whether
  ``speculative: auto`` may write one section with vLLM's per-batch-size k for it;
- the noun of distill's messages and the model card's ``role``;
- for a method batchspec can train, its trainer: a ``"module:name"`` resolved with importlib
  (:meth:`Method.trainer`; ``batchspec.distill.trainers``), so that this low layer names the
  trainer without importing torch or anything above it.

Adding a method (MTP, for a target with MTP layers) is one more object here, plus its trainer's
module where batchspec trains it. A method vLLM knows and batchspec does not (``medusa``, ...)
passes through as written: :func:`method` answers None for it and each caller says what that
means. No torch, no vLLM, nothing above ``spec/``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from batchspec.redact import sanitize_url

#: The methods batchspec knows (vLLM's ``SpeculativeConfig.method`` takes more; those pass
#: through unchecked).
SpeculativeMethod = Literal["draft_model", "pard", "eagle3", "peagle", "eagle", "ngram", "suffix"]


@dataclass(frozen=True)
class Package:
    """A package vLLM imports for a method, which batchspec's set-up does not install."""

    #: The module vLLM imports.
    module: str
    #: The name pip installs it by.
    name: str
    #: What it provides, in words.
    what: str
    #: How it builds.
    build: str
    #: The method to choose instead, and why.
    instead: str


@dataclass(frozen=True)
class Method:
    """What batchspec knows of one speculative method (see the module docstring)."""

    name: SpeculativeMethod
    #: What its model is: "draft" (a small model of its own), "head" (a head on the target's
    #: hidden states) or None (no model: it drafts from the text already seen). The model card's
    #: ``role`` and distill's messages name it.
    role: Literal["draft", "head"] | None
    #: Checkpoint detection: speculators' ``speculators_model_type`` values that mean it.
    speculators_types: tuple[str, ...] = ()
    #: Checkpoint detection: a part of an ``architectures`` name (lower case) that means it.
    architecture: str | None = None
    #: Checkpoint detection: ``model_type`` values that mean it.
    model_types: tuple[str, ...] = ()
    #: Checkpoint detection: ``config.json`` keys whose integer value means it (a parallel
    #: drafter's mask token; a head's may sit in its ``transformer_layer_config``).
    config_keys: tuple[str, ...] = ()
    #: A parallel drafter's weights also draft a token a pass: the method that runs them so
    #: (``tune`` weighs both; a config naming the mask token turns this one's detection into
    #: the parallel one).
    sequential: str | None = None
    #: How vLLM's ``speculative_config`` says it, where not by this name: its ``method`` and the
    #: keys that go with it (:func:`vllm_speculative`).
    vllm_method: str | None = None
    vllm_keys: tuple[tuple[str, Any], ...] = ()
    #: Its head reads the target's auxiliary layers (EAGLE-3's ids, checked against the target).
    aux_layers: bool = False
    #: A package vLLM imports for it, checked before weights load (None: none beyond vLLM).
    package: Package | None = None
    #: ``tune`` labels a family of it ``METHOD:NAME`` (a draft model's is its name alone).
    labelled: bool = True
    #: ``speculative: auto`` may write one section with vLLM's per-batch-size k for it (the
    #: CPU measurement that justifies it covered draft models only: BENCHMARKS.md).
    batch_size_k: bool = False
    #: distill's trainer, ``"module:name"`` (None: batchspec does not train it).
    trainer_ref: str | None = None

    @property
    def reads_hidden_states(self) -> bool:
        """Its model is a head on the target's hidden states."""
        return self.role == "head"

    @property
    def needs_model(self) -> bool:
        return self.role is not None

    @property
    def trainable(self) -> bool:
        return self.trainer_ref is not None

    def trainer(self) -> Any:
        """distill's trainer for this method (batchspec.distill.trainers), imported on first use."""
        if self.trainer_ref is None:
            raise ValueError(f"batchspec does not train {self.name}")
        module, _, name = self.trainer_ref.partition(":")
        return getattr(importlib.import_module(module), name)


DRAFT_MODEL = Method(
    "draft_model",
    role="draft",
    labelled=False,
    batch_size_k=True,
    trainer_ref="batchspec.distill.trainers:DRAFT_MODEL_TRAINER",
)
#: Where a parallel draft's ``config.json`` names its mask token, in the order vLLM looks.
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")

#: A parallel draft (PARD): a draft model vLLM runs once a step, k - 1 mask tokens after the
#: request's last token, proposing all k tokens in that one pass; its config names the mask token.
PARD = Method(
    "pard",
    role="draft",
    config_keys=MASK_TOKEN_KEYS,
    sequential="draft_model",
    vllm_method="draft_model",
    vllm_keys=(("parallel_drafting", True),),
    trainer_ref="batchspec.distill.trainers:PARD_TRAINER",
)
EAGLE3 = Method(
    "eagle3",
    role="head",
    speculators_types=("eagle3",),
    architecture="eagle3",
    aux_layers=True,
    trainer_ref="batchspec.distill.trainers:EAGLE3_TRAINER",
)
#: A parallel EAGLE-3 head's weight vLLM reads at its mask positions in place of the target's
#: hidden states (P-EAGLE's; vLLM 0.32's ``llama_eagle3.py`` loads it by this name).
MASK_HIDDEN = "mask_hidden"
#: A parallel EAGLE-3 head (P-EAGLE): an EAGLE-3 head vLLM runs once a step, k - 1 mask
#: positions after the request's last token (the mask token's embedding beside a learned
#: ``mask_hidden`` in place of the target's hidden states), proposing all k tokens in that pass.
PEAGLE = Method(
    "peagle",
    role="head",
    speculators_types=("peagle",),
    config_keys=MASK_TOKEN_KEYS,
    sequential="eagle3",
    vllm_method="eagle3",
    vllm_keys=(("parallel_drafting", True),),
    aux_layers=True,
    trainer_ref="batchspec.distill.trainers:PEAGLE_TRAINER",
)
EAGLE = Method(
    "eagle", role="head", speculators_types=("eagle",), architecture="eagle", model_types=("eagle",)
)
NGRAM = Method("ngram", role=None)
SUFFIX = Method(
    "suffix",
    role=None,
    package=Package(
        module="arctic_inference",
        name="arctic-inference",
        what="suffix decoding's index",
        build="a source build: C++20, cmake, nanobind",
        instead="ngram, which also drafts from text already seen",
    ),
)

#: Every method batchspec knows, by name. Detection asks them in this order (EAGLE-3 before
#: EAGLE: an ``Eagle3...`` architecture holds both names).
METHODS: dict[str, Method] = {m.name: m for m in (DRAFT_MODEL, PARD, EAGLE3, PEAGLE, EAGLE, NGRAM, SUFFIX)}

#: Methods vLLM 0.32 lists that batchspec refuses before any work (exit 2, naming
#: ``speculative.method``), and why; docs/speculation.md says what was tried.
REFUSED: dict[str, str] = {
    "dflash": (
        "DFlash (a block-diffusion drafter) has not run on vLLM 0.32's CPU build here: a DFlash "
        "drafter built for the tiny target failed on its first step, and batchspec can neither "
        "check nor train one; use pard (a parallel draft) or peagle (a parallel EAGLE-3 head), "
        "which draft k tokens in one pass and run here"
    ),
}

#: The names of the methods whose model is a head on the target's hidden states.
HEAD_METHODS = tuple(m.name for m in METHODS.values() if m.reads_hidden_states)

#: The methods distill trains, in the order its ``--method`` lists them.
TRAINABLE = tuple(m.name for m in METHODS.values() if m.trainable)


def method(name: Any) -> Method | None:
    """The method named ``name``, or None for one batchspec does not know (or no name)."""
    return METHODS.get(name) if isinstance(name, str) else None


def reads_hidden_states(name: Any) -> bool:
    """Whether the method named ``name`` runs a head on the target's hidden states."""
    known = method(name)
    return known is not None and known.reads_hidden_states


def detect(config: dict) -> str:
    """What a checkpoint's config says it is: a method's name (speculators' algorithm name as
    written where batchspec does not know it), ``draft_model`` where nothing names a head; a
    drafter whose config names a mask token is its method's parallel form (``pard``,
    ``peagle``). Takes a config whose fields have any type (a mistyped one is
    :func:`batchspec.spec.checkpoints.load_config`'s to refuse)."""
    found = _named(config)
    parallel = next((m for m in METHODS.values() if m.sequential == found), None)
    if parallel is not None and mask_token(config) is not None:
        return parallel.name
    return found


def _named(config: dict) -> str:
    """The method a config names by type, architecture or model type (draft_model: none)."""
    kind = config.get("speculators_model_type")
    if isinstance(kind, str) and kind:
        return next((m.name for m in METHODS.values() if kind in m.speculators_types), kind)
    archs = config.get("architectures")
    archs = [a.lower() for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    model_type = config.get("model_type")
    for m in METHODS.values():
        if (m.architecture and any(m.architecture in a for a in archs)) or (
            isinstance(model_type, str) and model_type in m.model_types
        ):
            return m.name
    return DRAFT_MODEL.name


def mask_token(config: dict) -> int | None:
    """The mask token a parallel drafter's config names, as vLLM reads it (None: none): at its
    top level, or for a head in speculators' format, in its ``transformer_layer_config``."""
    layer = config.get("transformer_layer_config")
    for where in (config, layer if isinstance(layer, dict) else {}):
        for key in MASK_TOKEN_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def parallel_form(name: Any, keys: dict) -> str | None:
    """The parallel method a ``speculative_config`` means by vLLM's spelling (``name`` with
    ``keys``: ``draft_model`` or ``eagle3`` with ``parallel_drafting: true``), else None."""
    return next(
        (
            m.name
            for m in METHODS.values()
            if m.vllm_method == name and m.vllm_keys and all(keys.get(k) == v for k, v in m.vllm_keys)
        ),
        None,
    )


def is_draft(name: Any) -> bool:
    """Whether the method named ``name`` runs a draft model of its own (sequential or parallel)."""
    known = method(name)
    return known is not None and known.role == "draft"


def vllm_speculative(section: dict) -> dict:
    """A job's ``speculative`` section as vLLM's ``speculative_config`` takes it: a method vLLM
    names otherwise (``pard``: ``draft_model`` with ``parallel_drafting``) translated, any other
    as written."""
    known = method(section.get("method"))
    if known is None or known.vllm_method is None:
        return dict(section)
    return {**section, "method": known.vllm_method, **dict(known.vllm_keys)}


def family_label(name: Any, label: str, has_model: bool) -> str:
    """``tune``'s label for a family of candidates of method ``name`` whose model (or method)
    is ``label``: a draft model's label alone, ``METHOD:LABEL`` for a head, the method alone
    for a family with no model. A method batchspec does not know is labelled as a head is, its
    name through the sanitiser ``run`` uses."""
    known = method(name)
    if name is None or (known is not None and not known.labelled):
        return label
    shown = sanitize_url(str(name))
    return f"{shown}:{label}" if has_model else shown
