"""What we ask of vLLM without starting an engine: its version, spec keys checked against its
own config classes, the context length, sampling parameters, and the CPU build's refusals."""

from __future__ import annotations

import dataclasses

from batchspec.errors import SpecError
from batchspec.spec.build import check_known_keys
from batchspec.spec.model import JobSpec


def vllm_version() -> str:
    import vllm

    return vllm.__version__




def _bad_value_errors() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a bad value (VLLMClientError is not a ValueError)."""
    from vllm.exceptions import VLLMClientError

    return (TypeError, ValueError, VLLMClientError)




#: Why batchspec refuses random sampling with speculative decoding on vLLM's CPU build when its
#: vLLM plugin (batchspec.engine.cpu_plugin, which fixes it there) is not active.
CPU_SAMPLING_REFUSAL = (
    "temperature > 0 with speculative decoding is refused on vLLM's CPU build where batchspec's "
    "vLLM plugin is not active (turned off by BATCHSPEC_DISABLE_VLLM_PLUGIN or VLLM_PLUGINS, its "
    "entry point not installed, or a vLLM version it was not checked against): that build's "
    "rejection sampler returns corrupt tokens for sampled requests and for greedy requests batched "
    "with them; use temperature 0, or turn speculative decoding off"
)




def refuses_random_sampling(spec: JobSpec) -> bool:
    """True where vLLM's speculative random sampling is known to be broken: its CPU build, unless
    batchspec's vLLM plugin fixes it in the engines this process starts."""
    if spec.speculative is None:
        return False
    from vllm.platforms import current_platform

    from batchspec.engine import cpu_plugin

    return current_platform.is_cpu() and not cpu_plugin.active()




def _seeded_chunks_crash(spec: JobSpec) -> bool:
    """True where a seeded request split by chunked prefill would kill the engine: vLLM's CPU
    build without batchspec's plugin, for a job that can send a seed."""
    if "seed" not in spec.sampling and "seed" not in spec.input.sampling_columns:
        return False
    from vllm.platforms import current_platform

    from batchspec.engine import cpu_plugin

    return current_platform.is_cpu() and not cpu_plugin.active()




def check_vllm_keys(spec: JobSpec) -> None:
    """Check ``model.engine``, ``speculative`` and ``sampling`` keys against vLLM's own config
    classes, and build the job's SamplingParams once, so a typo exits 2 before any model loads."""
    from vllm import SamplingParams
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    engine_keys = {f.name for f in dataclasses.fields(EngineArgs)}
    check_known_keys(spec.model.engine, engine_keys, "model.engine")
    if spec.speculative is not None:
        spec_keys = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        check_known_keys(spec.speculative, spec_keys, "speculative")
    check_known_keys(spec.sampling, SamplingParams.__struct_fields__, "sampling")
    try:
        params = SamplingParams(**spec.sampling)
    except _bad_value_errors() as exc:
        raise SpecError("sampling", str(exc)) from exc
    if params.temperature > 0 and refuses_random_sampling(spec):
        raise SpecError("sampling.temperature",
                        f"{CPU_SAMPLING_REFUSAL} (SamplingParams' default temperature is 1.0)")


def max_model_len(spec: JobSpec) -> int:
    """The context length vLLM would use for this job: its own model config, built from the
    spec's engine arguments without loading weights (rope scaling, sliding windows and an
    explicit ``max_model_len`` all as vLLM resolves them)."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        config = EngineArgs(model=spec.model.target, **spec.model.engine).create_model_config()
    except (TypeError, ValueError) as exc:
        raise SpecError("model", f"vLLM refused the model configuration: {exc}") from exc
    return int(config.max_model_len)


def sampling_temperature(params: dict) -> float:
    """The temperature vLLM samples with under these SamplingParams fields (raises on bad ones)."""
    from vllm import SamplingParams

    return SamplingParams(**params).temperature
