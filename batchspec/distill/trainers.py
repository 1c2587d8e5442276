"""distill's trainers, one per method it trains: what differs between training a draft model, a
parallel draft, an EAGLE-3 head and a parallel one, and nothing else
(:mod:`batchspec.distill.session` runs the steps they share: the sample, the target's text,
the evaluation, the install decision, the card).

Each method's object (:mod:`batchspec.spec.methods`) names its trainer here by
``"module:name"``; :meth:`batchspec.spec.methods.Method.trainer` imports it on first use. A
trainer:

- ``check(spec, opts)``: the options it refuses before any work (SpecError, exit 2);
- ``start(spec, opts, say)``: the model to train (its size is part of how much data it needs);
- ``train(spec, opts, model, examples, validation, steps, ...)``: the training, its result a
  :class:`batchspec.distill.train.TrainResult` (or EAGLE-3's own, with the same fields);
- ``save(model, spec, built, parameters, say)``: the model as vLLM loads it, into ``built``,
  returning its layers for the card;
- ``baseline(spec, opts, work, say)``: the drafter the new one must beat, as the held-out
  evaluation runs it (None: none);
- ``max_windows(opts)``: how long the target's continuations may grow for it, in windows of the
  job's length.

torch, transformers and the trainers' own modules are imported inside each call, so that
checking the options imports none of them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchspec.distill.card import public_path
from batchspec.distill.options import DistillOptions, job_k
from batchspec.errors import SpecError
from batchspec.spec.methods import DRAFT_MODEL, EAGLE3, PARD, PEAGLE
from batchspec.spec.model import JobSpec

Say = Callable[[str], None]


class DraftModelTrainer:
    """A small model of its own, started from ``--draft`` or from the target's first layers,
    trained on the target's tokens (batchspec/distill/train.py)."""

    method = DRAFT_MODEL

    def check(self, spec: JobSpec, opts: DistillOptions) -> None:
        for name, given in (("--head", opts.head), ("--aux-layers", opts.aux_layers)):
            if given:
                raise SpecError(name, "applies to --method eagle3 or peagle (an EAGLE-3 head) only")
        if opts.mask_token is not None and self.method is not PARD:
            raise SpecError("--mask-token", "applies to --method pard (a parallel draft) only")
        if opts.init == "draft" and not opts.draft:
            raise SpecError("--draft", "give the draft to start from, or --init target --layers N")

    def start(self, spec: JobSpec, opts: DistillOptions, say: Say) -> Any:
        from batchspec.distill import train

        if opts.init == "target":
            say(f"new draft: the target's embeddings, first {opts.layers} layer(s) and head")
            return train.draft_from_target(spec.model.target, opts.layers)
        return train.load_draft(opts.draft)

    def train(
        self,
        spec: JobSpec,
        opts: DistillOptions,
        draft: Any,
        examples: list[dict],
        validation: list[dict],
        steps: int,
        *,
        window: int,
        features: Path,
        say: Say,
        deadline: float | None,
    ) -> Any:
        from batchspec.distill import device as devices
        from batchspec.distill import train

        _, special = train.tokenizer_vocab(spec.model.target)
        pad_id = next((v for v in (special["pad"], special["eos"], 0) if v is not None), 0)
        device = devices.resolve(opts.device)
        if device == "cuda":
            # fp32 weights, their gradients and AdamW's two moments: 16 bytes a parameter
            parameters = sum(p.numel() for p in draft.parameters())
            devices.wait_for_gpu_memory(
                16 * parameters + devices.FORWARD_RESERVE, "the draft to train (fp32 master weights)", say
            )
        return train.train_draft(
            draft,
            examples,
            steps,
            opts.lr,
            opts.batch_size,
            opts.seed,
            pad_id,
            progress=say,
            window=window,
            validation=validation,
            patience=opts.patience,
            deadline=deadline,
            device=device,
            k=opts.k or job_k(spec),
            objective=self.objective(spec, opts, draft),
        )

    def objective(self, spec: JobSpec, opts: DistillOptions, draft: Any) -> Any:
        """What the draft learns beyond the target's next token (None: nothing)."""
        return None

    def max_windows(self, opts: DistillOptions) -> int:
        """The longest continuation, in windows of the job's length (batchspec/distill/data.py)."""
        from batchspec.distill.data import MAX_WINDOWS

        return MAX_WINDOWS

    def save(self, draft: Any, spec: JobSpec, built: Path, parameters: int, say: Say) -> int:
        from batchspec.distill import train

        train.save_draft(draft, spec.model.target, built)
        layers = draft.config.num_hidden_layers
        say(f"built the new draft ({parameters / 1e6:.2f}M parameters, {layers} layers)")
        return layers

    def baseline(self, spec: JobSpec, opts: DistillOptions, work: Path, say: Say) -> str | None:
        """The drafter the new one must beat, as the evaluation runs it: ``--draft``."""
        return opts.start


class ParallelDraftTrainer(DraftModelTrainer):
    """A parallel draft (PARD): a draft model, started as :class:`DraftModelTrainer`'s, that
    also learns to propose the k - 1 tokens after the next from mask tokens, so that vLLM drafts
    a whole step in one pass (batchspec/distill/pard.py); its config names the mask token."""

    method = PARD

    def check(self, spec: JobSpec, opts: DistillOptions) -> None:
        super().check(spec, opts)
        self.mask_token(spec, opts)

    def mask_token(self, spec: JobSpec, opts: DistillOptions) -> int:
        """The mask token the draft reads (``--mask-token``, the starting draft's own, else the
        pad token: batchspec/distill/pard.py); checked before any work."""
        from batchspec.distill import pard
        from batchspec.distill.train import tokenizer_vocab
        from batchspec.spec.checkpoints import read_config, text_config

        source = opts.draft if opts.init == "draft" and opts.draft else spec.model.target
        config = text_config(read_config(source) or {})
        _, special = tokenizer_vocab(source)
        return pard.choose_mask_token(config, int(config.get("vocab_size") or 0), special, opts.mask_token)

    def start(self, spec: JobSpec, opts: DistillOptions, say: Say) -> Any:
        from batchspec.distill.pard import WRITTEN_KEY

        draft = super().start(spec, opts, say)
        mask = self.mask_token(spec, opts)
        setattr(draft.config, WRITTEN_KEY, mask)  # saved with it, in its config.json
        say(f"parallel draft: mask token {mask}, {opts.k or job_k(spec)} tokens a pass")
        return draft

    def objective(self, spec: JobSpec, opts: DistillOptions, draft: Any) -> Any:
        from batchspec.distill.pard import WRITTEN_KEY, ParallelObjective

        return ParallelObjective(k=opts.k or job_k(spec), mask=getattr(draft.config, WRITTEN_KEY))

    def baseline(self, spec: JobSpec, opts: DistillOptions, work: Path, say: Say) -> str | None:
        """``--draft`` drafting in parallel: where its config names no mask token, a copy of it
        (its weights linked, not copied) whose config names the one the new draft reads, so
        that both are judged drafting the same way."""
        from batchspec.distill import pard
        from batchspec.spec.checkpoints import read_config
        from batchspec.spec.methods import mask_token

        if not opts.start or mask_token(read_config(opts.start) or {}) is not None:
            return opts.start
        copy = work / "baseline-parallel"
        if copy.exists():
            shutil.rmtree(copy)
        copy.mkdir(parents=True)
        for item in Path(opts.start).expanduser().resolve().iterdir():
            (copy / item.name).symlink_to(item)
        (copy / "config.json").unlink()
        shutil.copyfile(Path(opts.start).expanduser() / "config.json", copy / "config.json")
        mask = self.mask_token(spec, opts)
        pard.write_mask_token(copy, mask)
        say(f"the starting draft, judged drafting in parallel: mask token {mask}")
        return str(copy)


class Eagle3Trainer:
    """An EAGLE-3 head on the target's hidden states, new or continued from ``--head``, trained on
    features from the target's own forward pass (batchspec/distill/eagle3.py)."""

    method = EAGLE3

    def check(self, spec: JobSpec, opts: DistillOptions) -> None:
        """What ``--method eagle3`` refuses: the draft model's options, a ``--head`` that is not
        an EAGLE-3 head fitting the target, auxiliary layers the target does not have."""
        from batchspec.engine.heads import check_head_fits
        from batchspec.spec.checkpoints import read_config, text_config
        from batchspec.spec.methods import detect

        if opts.draft:
            raise SpecError(
                "--draft",
                f"--method {self.method.name} trains a head: give the head to start from with --head "
                "(none: a new head)",
            )
        if opts.init != "draft" or opts.layers != 1:
            raise SpecError(
                "--init" if opts.init != "draft" else "--layers",
                "applies to draft models: a head is one decoder layer on the target's hidden states",
            )
        if opts.mask_token is not None and self.method is not PEAGLE:
            raise SpecError("--mask-token", "applies to --method pard or peagle (a parallel drafter) only")
        if opts.logprobs:
            raise SpecError(
                "--logprobs",
                "a head learns the target's greedy token from the target's own forward pass (its "
                f"full logits, no top-K needed): leave --logprobs out with --method {self.method.name}",
            )
        target = read_config(spec.model.target)
        if target is None:
            raise SpecError(
                "model.target",
                f"{spec.model.target}: --method {self.method.name} reads the target's hidden states "
                "with its own forward pass, so the target must be a local model directory with a config.json",
            )
        target = text_config(target)
        layers = int(target.get("num_hidden_layers") or 0)
        if opts.head:
            config = read_config(opts.head)
            if config is None:
                raise SpecError("--head", f"{opts.head}: not a local model directory with a config.json")
            found = detect(config)
            if found not in (EAGLE3.name, PEAGLE.name):
                raise SpecError(
                    "--head", f"{opts.head} is not an EAGLE-3 head (its config.json says {found})"
                )
            if opts.aux_layers:
                raise SpecError("--aux-layers", "--head has its own auxiliary layers: leave --aux-layers out")
            check_head_fits(Path(opts.head).expanduser(), config, target, found, "--head")
        if opts.aux_layers is not None:
            bad = [i for i in opts.aux_layers if not 0 <= i < layers]
            if bad or not opts.aux_layers:
                raise SpecError(
                    "--aux-layers",
                    f"{list(opts.aux_layers)}: the target has {layers} layers (ids 0..{layers - 1})",
                )

    def start(self, spec: JobSpec, opts: DistillOptions, say: Say) -> Any:
        from batchspec.distill import eagle3

        if opts.head:
            say(f"head: continuing {public_path(opts.head)}")
            return eagle3.load_head(opts.head, spec.model.target)
        config = eagle3.head_config(
            eagle3.target_config(spec.model.target),
            list(opts.aux_layers) if opts.aux_layers else None,
            k=job_k(spec),
            verifier=public_path(spec.model.target) or "",
        )
        say(
            "new EAGLE-3 head on the target's layers "
            f"{config['eagle_aux_hidden_state_layer_ids']} (its output layer copied from the target)"
        )
        return eagle3.new_head(spec.model.target, config, seed=opts.seed)

    def train(
        self,
        spec: JobSpec,
        opts: DistillOptions,
        head: Any,
        examples: list[dict],
        validation: list[dict],
        steps: int,
        *,
        window: int,
        features: Path,
        say: Say,
        deadline: float | None,
    ) -> Any:
        """The target's hidden states for the training and validation rows (streamed to chunk
        files under ``features``; the target loaded once, on ``--device``), then the head
        trained on them there."""
        from batchspec.distill import device as devices
        from batchspec.distill import eagle3
        from batchspec.distill import features as feats

        device = devices.resolve(opts.device)
        aux = list(head.config["eagle_aux_hidden_state_layer_ids"])
        tag = "-".join(map(str, aux))
        say(f"features: the target's hidden states at layers {aux}, from its own forward pass on {device}")
        target = feats.Target(spec.model.target, device, say)
        try:
            train = feats.collect_features(
                spec.model.target,
                examples,
                aux,
                features / f"train-{tag}",
                say=say,
                deadline=deadline,
                target=target,
            )
            held = feats.collect_features(
                spec.model.target,
                validation,
                aux,
                features / f"validation-{tag}",
                say=say,
                deadline=deadline,
                target=target,
            )
        finally:
            target.close()
        if not train.files:
            raise SpecError("--max-minutes", "no time was left to train the head: give it more minutes")
        say(f"training the head on {train.sequences} sequences ({train.tokens} tokens)")
        return eagle3.train_head(
            head,
            train.files,
            held.files,
            steps,
            opts.lr,
            opts.batch_size,
            opts.seed,
            say=say,
            patience=opts.patience,
            deadline=deadline,
            device=device,
            parallel_k=self.parallel_k(spec, opts),
        )

    def parallel_k(self, spec: JobSpec, opts: DistillOptions) -> int | None:
        """Tokens a pass a parallel head learns to draft (None: a head drafting one a step)."""
        return None

    def save(self, head: Any, spec: JobSpec, built: Path, parameters: int, say: Say) -> int:
        from batchspec.distill import eagle3

        eagle3.save_head(head, built)
        say(f"built the new head ({parameters / 1e6:.2f}M parameters)")
        return 1

    def baseline(self, spec: JobSpec, opts: DistillOptions, work: Path, say: Say) -> str | None:
        """The head the new one must beat: ``--head``."""
        return opts.start

    def max_windows(self, opts: DistillOptions) -> int:
        """A new head's continuations are longer than a draft's (batchspec/distill/data.py)."""
        from batchspec.distill.data import MAX_WINDOWS, NEW_HEAD_WINDOWS

        return MAX_WINDOWS if opts.head else NEW_HEAD_WINDOWS


class ParallelHeadTrainer(Eagle3Trainer):
    """A parallel EAGLE-3 head (P-EAGLE): an EAGLE-3 head, new or continued from ``--head``, that
    also learns ``mask_hidden`` and to propose the k - 1 tokens after the next from mask
    positions, so that vLLM drafts a whole step in one pass (:meth:`batchspec.distill.eagle3.
    Eagle3Head.parallel`); its config names the mask token."""

    method = PEAGLE

    def check(self, spec: JobSpec, opts: DistillOptions) -> None:
        super().check(spec, opts)
        self.mask_token(spec, opts)

    def mask_token(self, spec: JobSpec, opts: DistillOptions) -> int:
        """``--mask-token``, the starting head's own, else the target's pad token (the rules of
        batchspec/distill/pard.py, over the target's vocabulary, which a head proposes in)."""
        from batchspec.distill import pard
        from batchspec.distill.train import tokenizer_vocab
        from batchspec.spec.checkpoints import read_config, text_config
        from batchspec.spec.methods import mask_token

        target = text_config(read_config(spec.model.target) or {})
        head = read_config(opts.head) if opts.head else None
        own = {"mask_token_id": mask_token(head)} if head and mask_token(head) is not None else {}
        _, special = tokenizer_vocab(spec.model.target)
        return pard.choose_mask_token(own, int(target.get("vocab_size") or 0), special, opts.mask_token)

    def start(self, spec: JobSpec, opts: DistillOptions, say: Say) -> Any:
        head = super().start(spec, opts, say)
        mask = self.mask_token(spec, opts)
        head.make_parallel(mask)
        say(f"parallel head: mask token {mask}, {self.parallel_k(spec, opts)} tokens a pass")
        return head

    def parallel_k(self, spec: JobSpec, opts: DistillOptions) -> int | None:
        return opts.k or job_k(spec)

    def baseline(self, spec: JobSpec, opts: DistillOptions, work: Path, say: Say) -> str | None:
        """``--head`` drafting in parallel: where it is a head drafting a token a pass, a copy
        of it naming the new head's mask token, with ``mask_hidden`` zeros (what it starts from
        here), so that both are judged drafting the same way."""
        from batchspec.distill import eagle3
        from batchspec.spec.checkpoints import read_config
        from batchspec.spec.methods import mask_token

        if not opts.start or mask_token(read_config(opts.start) or {}) is not None:
            return opts.start
        copy = work / "baseline-parallel"
        if copy.exists():
            shutil.rmtree(copy)
        head = eagle3.load_head(opts.start, spec.model.target)
        mask = self.mask_token(spec, opts)
        head.make_parallel(mask)
        eagle3.save_head(head, copy)
        say(f"the starting head, judged drafting in parallel: mask token {mask}")
        return str(copy)


DRAFT_MODEL_TRAINER = DraftModelTrainer()
PARD_TRAINER = ParallelDraftTrainer()
EAGLE3_TRAINER = Eagle3Trainer()
PEAGLE_TRAINER = ParallelHeadTrainer()
