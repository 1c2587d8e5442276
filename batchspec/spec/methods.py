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
SpeculativeMethod = Literal["draft_model", "pard", "eagle3", "eagle", "ngram", "suffix"]


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
    #: draft's mask token).
    config_keys: tuple[str, ...] = ()
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
    vllm_method="draft_model",
    vllm_keys=(("parallel_drafting", True),),
    trainer_ref="batchspec.distill.trainers:PARD_TRAINER",
)
EAGLE3 = Method(
    "eagle3",
    role="head",
    speculators_types=("eagle3", "peagle"),
    architecture="eagle3",
    aux_layers=True,
    trainer_ref="batchspec.distill.trainers:EAGLE3_TRAINER",
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
METHODS: dict[str, Method] = {m.name: m for m in (DRAFT_MODEL, PARD, EAGLE3, EAGLE, NGRAM, SUFFIX)}

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
    written where batchspec does not know it), ``draft_model`` where nothing names a head. Takes
    a config whose fields have any type (a mistyped one is
    :func:`batchspec.spec.checkpoints.load_config`'s to refuse)."""
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
    for m in METHODS.values():
        if any(
            isinstance(config.get(key), int) and not isinstance(config.get(key), bool)
            for key in m.config_keys
        ):
            return m.name
    return DRAFT_MODEL.name


def mask_token(config: dict) -> int | None:
    """The mask token a parallel draft's config names, as vLLM reads it (None: none)."""
    for key in MASK_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


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
