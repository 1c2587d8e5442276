"""A row with images as vLLM's input: its images read and decoded (batchspec/io/images.py), its
messages rendered by vLLM's own chat renderer (the one ``LLM.chat`` uses: the model's chat
template, its placeholders, its processor), one row at a time; and, before any weights load,
whether a model takes images at all."""

from __future__ import annotations

from typing import Any

from batchspec.errors import RuntimeFailure, SpecError
from batchspec.io.image_reader import read_image
from batchspec.io.images import ImageError, ImageLimits, shown
from batchspec.io.rows import Row
from batchspec.spec.checkpoints import load_config
from batchspec.spec.model import JobSpec


class RowImageError(ValueError):
    """A row's images cannot be used: that row's error (its message is the error)."""


def takes_images(model: str, key: str = "model.target") -> bool | None:
    """Whether vLLM runs ``model`` (a local directory) with images: its architecture is one of
    vLLM's multimodal models, or, for one vLLM does not list, its config has a vision config.
    None where batchspec cannot tell before vLLM (a hub id, a URL)."""
    config = load_config(model, key)
    if config is None:
        return None
    architectures = config.get("architectures") or []
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        infos = [ModelRegistry._try_inspect_model_cls(arch) for arch in architectures]
    except Exception:  # noqa: BLE001 (a vLLM without this registry call: judge by the config)
        infos = []
    known = [info for info in infos if info is not None]
    if known:
        return any(info.supports_multimodal for info in known)
    return "vision_config" in config


def check_images(spec: JobSpec) -> None:
    """Exit 2 before any weights load where a job's rows carry images (``input.image_columns``)
    and its target is a text-only model, or where a row would have more images than the engine
    takes (``model.engine.limit_mm_per_prompt``)."""
    columns = spec.input.image_columns
    if not columns:
        return
    if takes_images(spec.model.target) is False:
        raise SpecError(
            "input.image_columns",
            f"the target {spec.model.target!r} is a text-only model: vLLM takes no images for it "
            "(image jobs need a vision-language model, docs/images.md)",
        )
    limit = image_limit(spec)
    if limit is not None and len(columns) > limit:
        raise SpecError(
            "input.image_columns",
            f"{len(columns)} image columns, but the engine takes {limit} image(s) a prompt "
            "(model.engine.limit_mm_per_prompt.image)",
        )


#: Vision-language targets whose image token vLLM's drafter (vLLM 0.32, its
#: ``llm_base_proposer``) reads from a field other than ``image_token_index``: for any other
#: multimodal target, a draft model's engine fails at start-up without that field.
_IMAGE_TOKEN_ELSEWHERE = frozenset(
    {
        "BailingMoeV3VLForConditionalGeneration",
        "Cohere2VisionForConditionalGeneration",
        "Exaone4_5_ForConditionalGeneration",
        "GlmOcrForConditionalGeneration",
        "HunYuanVLForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "MiMoV2OmniForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Step3p7ForConditionalGeneration",
        "PixtralForConditionalGeneration",
        "KimiK25ForConditionalGeneration",
        "KimiK3ForConditionalGeneration",
        "NemotronH_Nano_VL_V2",
    }
)


def check_multimodal_drafter(
    target: str, method: Any, key: str = "speculative", hf_overrides: Any = None
) -> None:
    """Exit 2 before any weights load for a drafter vLLM cannot run beside a vision-language
    target: a head (EAGLE, EAGLE-3, P-EAGLE) where the target's vLLM model has no EAGLE-3
    interface (Idefics3 has none), and a draft model where vLLM's drafter would look for the
    target's ``image_token_index`` and its config has none (``model.engine.hf_overrides`` may
    give it). N-gram and suffix decoding need neither."""
    from batchspec.spec.methods import is_draft, reads_hidden_states

    if not (is_draft(method) or reads_hidden_states(method)) or takes_images(target) is not True:
        return
    config = load_config(target, "model.target") or {}
    architectures = [a for a in config.get("architectures") or () if isinstance(a, str)]
    named = ", ".join(architectures) or "its architecture"
    if reads_hidden_states(method):
        if not any(_has_eagle3(arch) for arch in architectures):
            raise SpecError(
                f"{key}.method",
                f"vLLM runs no {method} head on the vision-language target {target!r} ({named}: "
                "its vLLM model takes no EAGLE-3 head); use a draft model or ngram (docs/images.md)",
            )
        return
    overrides = hf_overrides if isinstance(hf_overrides, dict) else {}
    if "image_token_index" in config or "image_token_index" in overrides:
        return
    if any(arch in _IMAGE_TOKEN_ELSEWHERE for arch in architectures):
        return
    token = config.get("image_token_id")
    raise SpecError(
        f"{key}.method",
        f"vLLM's drafter reads a vision-language target's image token from its config's "
        f"image_token_index, which {target!r} ({named}) has none of: give it with "
        f"model.engine.hf_overrides: {{image_token_index: {token if isinstance(token, int) else 'ID'}}} "
        "(docs/images.md)",
    )


def _has_eagle3(architecture: str) -> bool:
    """Whether vLLM's model of ``architecture`` takes an EAGLE-3 head."""
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(architecture)
    except Exception:  # noqa: BLE001 (an architecture vLLM cannot load: vLLM will say so)
        return True
    return cls is None or bool(supports_eagle3(cls))


def image_limit(spec: JobSpec) -> int | None:
    """The images a prompt may have, where the job sets it (``limit_mm_per_prompt``)."""
    limits = spec.model.engine.get("limit_mm_per_prompt")
    value = limits.get("image") if isinstance(limits, dict) else None
    if isinstance(value, dict):  # vLLM's {"count": N, ...} form
        value = value.get("count")
    return value if isinstance(value, int) else None


class ImagePrompts:
    """Rows with images made into vLLM's engine inputs, through the engine's own chat renderer."""

    def __init__(self, spec: JobSpec):
        self.limits = ImageLimits.of(spec.input)
        self.limit = image_limit(spec)
        self.takes_images = takes_images(spec.model.target)

    def prepare(self, llm: Any, row: Row, template_kwargs: dict) -> Any:
        """The row's engine input for ``llm``, vLLM's ``LLM``: its prompt token ids (image
        placeholders expanded) and its processed images. RowImageError for a bad image; what
        vLLM's renderer raises is raised (the caller makes it the row's error)."""
        if self.takes_images is False:
            raise RowImageError("bad image: the target is a text-only model and takes no images")
        refs = row.images or []
        limit = _engine_limit(llm, self.limit)
        if limit is not None and len(refs) > limit:  # checked before any image is read
            raise RowImageError(
                f"bad image: {len(refs)} images, the engine takes {limit} a prompt "
                "(model.engine.limit_mm_per_prompt.image)"
            )
        images = read_row_images(refs, self.limits)
        conversation = [_vllm_message(m, images) for m in row.messages or ()]
        del images  # vLLM's processor holds what it needs; the decoded pixels go with this frame
        return llm._preprocess_chat_one(conversation, chat_template_kwargs=template_kwargs or None)


def read_row_images(refs: list, limits: ImageLimits) -> list:
    """A row's images read and decoded (``read_image``), in order: RowImageError naming the
    bad one; RuntimeFailure where a store failed past its retries (the run's failure)."""
    images = []
    for i, ref in enumerate(refs):
        try:
            images.append(read_image(ref, limits))
        except ImageError as exc:
            where = f"image {i + 1} of {len(refs)}, " if len(refs) > 1 else ""
            raise RowImageError(f"bad image: {where}{exc}") from exc
        except RuntimeFailure:
            raise  # the store failed past its retries: the run's failure, not the row's
        except Exception as exc:  # noqa: BLE001 (whatever else a library raises: this row's)
            raise RowImageError(f"bad image: cannot read {shown(ref)}: {type(exc).__name__}") from exc
    return images


def _engine_limit(llm: Any, asked: int | None) -> int | None:
    """The images a prompt may have on this engine: what vLLM's config holds (999 where the job
    sets none), else what the job asked."""
    try:
        return int(llm.llm_engine.model_config.multimodal_config.get_limit_per_prompt("image"))
    except Exception:  # noqa: BLE001 (a vLLM that keeps it elsewhere: the job's own figure)
        return asked


def _vllm_message(message: dict, images: list) -> dict:
    """One message in the form vLLM's chat renderer takes: an image part as a decoded image."""
    content = message.get("content")
    if isinstance(content, str):
        return message
    parts = [
        {"type": "image_pil", "image_pil": images[p["image"]]} if p["type"] == "image" else p for p in content
    ]
    return {**message, "content": parts}
