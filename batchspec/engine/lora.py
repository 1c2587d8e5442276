"""LoRA adapters of the target (``model.lora``): checked before any weights load, turned into
vLLM's engine arguments and per-request ``LoRARequest``s.

A local adapter is a directory in PEFT's format (``adapter_config.json`` with ``peft_type: LORA``
and its rank ``r``, and the weights); it is read here so that a wrong path, a config that is not
a LoRA or a rank over ``model.lora.max_lora_rank`` exits 2 naming the key, before the engine
starts. Any other value is a model id, which vLLM resolves itself (from its cache: no hub is
needed where the adapter was downloaded before)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchspec.errors import SpecError
from batchspec.spec.model import JobSpec, LoraSpec

#: Where a local adapter keeps its settings (PEFT's name).
CONFIG_FILE = "adapter_config.json"
#: The weight files PEFT writes (one of them must be there).
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: The rank vLLM is given when no local adapter says what it needs.
DEFAULT_RANK = 16


def is_local(source: str) -> bool:
    """A path on this machine (what exists, or what is spelled as a path), not a model id."""
    return Path(source).expanduser().exists() or source.startswith((".", "/", "~")) or source.count("/") > 1


@dataclass(frozen=True)
class Adapter:
    """One adapter as vLLM is given it."""

    name: str
    #: vLLM's integer id for it (1, 2, ... in the spec's order; 0 means no adapter to vLLM).
    int_id: int
    #: The absolute directory of a local adapter, or the model id as given.
    path: str
    #: ``r`` from a local adapter's config; None for a model id.
    rank: int | None


def read_adapters(lora: LoraSpec) -> list[Adapter]:
    """The spec's adapters, each local one's directory and config checked (SpecError naming
    ``model.lora.adapters.<name>`` otherwise)."""
    adapters = []
    for int_id, (name, source) in enumerate(lora.adapters.items(), start=1):
        key = f"model.lora.adapters.{name}"
        if not is_local(source):
            adapters.append(Adapter(name, int_id, source, None))
            continue
        directory = Path(source).expanduser().resolve()
        if not directory.is_dir():
            raise SpecError(key, f"no adapter directory at {source}")
        try:
            config = json.loads((directory / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise SpecError(key, f"{source} has no {CONFIG_FILE}: not an adapter in PEFT's format") from None
        except (OSError, ValueError) as exc:
            raise SpecError(key, f"cannot read {source}/{CONFIG_FILE}: {exc}") from exc
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
            raise SpecError(key, f"{source} is a {kind} adapter; vLLM serves LoRA adapters only")
        rank = config.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise SpecError(key, f"{source}/{CONFIG_FILE} has no rank r (got {rank!r})")
        if not any((directory / f).is_file() for f in WEIGHT_FILES):
            raise SpecError(key, f"{source} has no weights ({' or '.join(WEIGHT_FILES)})")
        adapters.append(Adapter(name, int_id, str(directory), rank))
    return adapters


def supported_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values vLLM accepts."""
    from typing import get_args

    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:  # another vLLM: its LoRAConfig checks the value when the engine starts
        return (1, 8, 16, 32, 64, 128, 256, 320, 512)
    return tuple(sorted(r for r in get_args(MaxLoRARanks) if isinstance(r, int)))


def engine_args(lora: LoraSpec, adapters: list[Adapter]) -> dict[str, Any]:
    """vLLM's LoRA engine arguments for the spec: ``enable_lora``, ``max_loras`` (default: every
    adapter fits one batch) and ``max_lora_rank`` (default: the smallest rank vLLM accepts that
    fits the largest local adapter); SpecError naming the key for a rank that does not fit."""
    ranks = supported_ranks()
    largest = max((a.rank for a in adapters if a.rank is not None), default=None)
    rank = lora.max_lora_rank
    if rank is None:
        wanted = largest or DEFAULT_RANK
        rank = next((r for r in ranks if r >= wanted), None)
        if rank is None:
            raise SpecError(
                "model.lora.adapters",
                f"an adapter has rank {largest}, more than vLLM supports (at most {ranks[-1]})",
            )
    elif rank not in ranks:
        raise SpecError(
            "model.lora.max_lora_rank", f"vLLM accepts one of {', '.join(map(str, ranks))}; got {rank}"
        )
    for a in adapters:
        if a.rank is not None and a.rank > rank:
            raise SpecError(
                f"model.lora.adapters.{a.name}",
                f"rank {a.rank} is more than model.lora.max_lora_rank ({rank})",
            )
    return {"enable_lora": True, "max_loras": lora.max_loras or len(adapters), "max_lora_rank": rank}


#: Why a job that batches base-model rows with adapter rows is refused where batchspec's vLLM
#: plugin is off on vLLM's CPU build (see batchspec.engine.cpu_plugin, fix 3).
CPU_MIXED_REFUSAL = (
    "vLLM's CPU build runs a base-model row batched with adapter rows with one "
    "of their adapters, and batchspec's vLLM plugin, which fixes that, is off"
)


def check_lora(spec: JobSpec) -> dict[str, Any]:
    """Check ``model.lora`` (adapters readable, ranks fitting, base-model rows batched with
    adapter rows only where that is right) and return the engine arguments it adds (none
    without LoRA)."""
    lora = spec.model.lora
    if lora is None:
        return {}
    args = engine_args(lora, read_adapters(lora))
    if spec.input.lora_column and lora.adapter is None and _cpu_without_fix():
        raise SpecError(
            "input.lora_column",
            f"{CPU_MIXED_REFUSAL}: give every row an adapter "
            "(model.lora.adapter for null cells) or turn the "
            "plugin on",
        )
    return args


def _cpu_without_fix() -> bool:
    from vllm.platforms import current_platform

    from batchspec.engine import cpu_plugin

    return current_platform.is_cpu() and not cpu_plugin.active()


class Adapters:
    """The job's adapters as vLLM ``LoRARequest``s, by name, and which one a row runs with."""

    def __init__(self, spec: JobSpec):
        lora = spec.model.lora
        self.default = lora.adapter if lora is not None else None
        self.column = spec.input.lora_column
        self.names = tuple(lora.adapters) if lora is not None else ()
        self._requests: dict[str, Any] = {}
        if lora is not None:
            from vllm.lora.request import LoRARequest

            self._requests = {a.name: LoRARequest(a.name, a.int_id, a.path) for a in read_adapters(lora)}

    def pick(self, name: str | None) -> tuple[str | None, Any]:
        """(adapter name, LoRARequest) for a row whose column holds ``name`` (None: the job's
        adapter, or the base model: (None, None)); ValueError naming the column for an unknown
        name."""
        name = name if name is not None else self.default
        if name is None:
            return None, None
        request = self._requests.get(name)
        if request is None:
            raise ValueError(unknown_adapter(name, self.column, self.names))
        return name, request


def unknown_adapter(name: str, column: str | None, names) -> str:
    """The error of a row whose LoRA column names no adapter of the job."""
    return (
        f"unknown LoRA adapter: {name!r} in column {column!r} is not one of "
        f"model.lora.adapters ({', '.join(names)})"
    )
