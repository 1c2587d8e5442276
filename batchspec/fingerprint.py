"""What shapes a job's output, hashed per component, so that a rerun with a different spec
cannot mix its rows with the old ones silently.

Store ``{"fingerprint_version": FINGERPRINT_VERSION, "fingerprint": spec_fingerprint(spec)}``
beside the output; on a rerun, :func:`describe_changes` names the components that differ.
Components (each a 16-hex-digit prefix of the SHA-256 of a canonical JSON):

- ``model.target``: the target model's identity. For a local directory: ``config.json``, the
  names and sizes of the weight files (``*.safetensors``, ``*.bin``) and the SHA-256 of the
  tokenizer, chat-template and generation-config files (not the directory's path: a copy of
  the model elsewhere is the same model). For a hub id or URL: the id (URL sanitised) plus
  ``model.engine.revision`` and ``tokenizer_revision``.
- ``speculative.model``: the draft's identity, the same way with ``speculative.revision``;
  absent when there is no draft model (speculation off, or ngram/suffix methods).
- ``speculative``: the speculative section without ``model`` (null when speculation is off).
- ``model.engine``: every engine argument except :data:`THROUGHPUT_ENGINE_KEYS` (speed, memory,
  parallelism and logging knobs that leave the text unchanged) and credentials (``hf_token``).
  A key in neither list counts, so an argument vLLM adds later is assumed to shape the output;
  its value is taken from the public view, so a string under a key that view does not know to
  be harmless (:data:`batchspec.redact.ENGINE_STRING_KEYS`) counts by presence only. Counted
  on purpose: dtype, max_model_len, quantization, kv_cache_dtype (it changes numerics),
  tokenizer, tokenizer_mode, revision, seed, trust_remote_code, hf_overrides, generation_config,
  override_generation_config, ...
- ``sampling``: the SamplingParams arguments.
- ``columns``: ``input.prompt_column``, ``messages_column``, ``id_column``,
  ``sampling_columns`` and ``output.keep_columns``.

Secrets never enter a component: storage options are not components, and the engine arguments
are hashed from :func:`batchspec.redact.public_spec`'s view.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchspec.redact import is_secret_key, public_spec, sanitize_url
from batchspec.spec import JobSpec

#: Bump when what a component covers changes, so old and new fingerprints can be told apart.
FINGERPRINT_VERSION = 1

#: Component names, in the order :func:`describe_changes` reports them.
COMPONENTS = ("model.target", "speculative.model", "speculative", "model.engine", "sampling",
              "columns")

#: Engine arguments that change speed, memory or logging but not the generated text.
THROUGHPUT_ENGINE_KEYS = frozenset({
    # batching and scheduling
    "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills",
    "max_long_partial_prefills", "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive", "enable_chunked_prefill", "scheduling_policy",
    "scheduler_cls", "async_scheduling", "stream_interval", "max_num_active_seqs",
    "max_num_queued_reqs", "max_num_queued_tokens", "max_num_scheduled_tokens",
    "prefill_schedule_interval", "enable_dbo", "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold", "ubatch_size",
    # memory and caches
    "gpu_memory_utilization", "swap_space", "cpu_offload_gb", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
    "prefix_cache_retention_interval", "enable_sleep_mode", "sleep_mode_offload_cudagraph",
    "enable_cumem_allocator", "kv_offloading_backend", "kv_offloading_size",
    "mm_processor_cache_gb", "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb",
    "offload_backend", "offload_group_size", "offload_num_in_group", "offload_prefetch_step",
    "offload_params",
    # compilation and kernels' launch mode
    "enforce_eager", "compilation_config", "cudagraph_capture_sizes",
    "max_cudagraph_capture_size", "optimization_level",
    # parallelism and placement
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "data_parallel_size_local", "data_parallel_rank", "data_parallel_start_rank",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_backend",
    "data_parallel_external_lb", "data_parallel_hybrid_lb", "distributed_executor_backend",
    "disable_custom_all_reduce", "max_parallel_loading_workers", "master_addr", "master_port",
    "nnodes", "node_rank", "numa_bind", "numa_bind_cpus", "numa_bind_nodes", "device_ids",
    "distributed_timeout_seconds", "cpu_distributed_timeout_seconds", "worker_cls",
    "worker_extension_cls",
    # loading speed, logging, metrics, process management
    "download_dir", "use_tqdm_on_load", "safetensors_load_strategy",
    "safetensors_prefetch_block_size", "safetensors_prefetch_num_threads", "disable_log_stats",
    "disable_log_requests", "enable_log_requests", "aggregate_engine_logging",
    "enable_logging_iteration_details", "log_level", "log_config_file", "logging_config",
    "kv_cache_metrics", "kv_cache_metrics_sample", "cudagraph_metrics", "enable_mfu_metrics",
    "enable_mm_processor_stats", "collect_detailed_traces", "otlp_traces_endpoint",
    "show_hidden_metrics_for_version", "profiler_config", "per_request_spec_decode_metrics",
    "shutdown_timeout", "served_model_name", "renderer_num_workers", "jit_monitor_mode",
    "jit_monitor_verbose", "enable_layerwise_nvtx_tracing", "ray_workers_use_nsight",
})

#: Files of a local model directory hashed whole: they decide how text becomes tokens, how chat
#: messages are rendered and which sampling defaults vLLM applies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
#: Weight files, identified by relative name and size (hashing gigabytes would take minutes).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def spec_fingerprint(spec: JobSpec) -> dict[str, str]:
    """Component name -> short SHA-256 (16 hex digits) of what that part of the spec means for
    the output; see the module docstring for the components."""
    engine = spec.model.engine
    components: dict[str, Any] = {
        "model.target": model_identity(spec.model.target, engine.get("revision"),
                                       engine.get("tokenizer_revision")),
    }
    speculative = spec.speculative
    if speculative is not None and speculative.get("model"):
        components["speculative.model"] = model_identity(
            str(speculative["model"]), speculative.get("revision"), None)
    components["speculative"] = (None if speculative is None else
                                 {k: v for k, v in speculative.items() if k != "model"})
    # The public view: URLs sanitised, and a string under a key public_spec does not know to be
    # harmless counts as present (``***``) but not by its value.
    public_engine = public_spec({"model": {"engine": dict(engine)}})["model"]["engine"]
    components["model.engine"] = {k: v for k, v in public_engine.items()
                                  if k not in THROUGHPUT_ENGINE_KEYS and not is_secret_key(k)}
    components["sampling"] = spec.sampling
    components["columns"] = {
        "prompt_column": spec.input.prompt_column,
        "messages_column": spec.input.messages_column,
        "id_column": spec.input.id_column,
        "sampling_columns": spec.input.sampling_columns,
        "keep_columns": None if spec.output.keep_columns is None else list(spec.output.keep_columns),
    }
    return {name: _digest(value) for name, value in components.items()}


def describe_changes(old: dict, new: dict) -> list[str]:
    """The components whose hashes differ between two fingerprints (one present in only one of
    them counts as changed), in :data:`COMPONENTS` order, then any others sorted by name."""
    names = set(old) | set(new)
    ordered = [c for c in COMPONENTS if c in names] + sorted(names - set(COMPONENTS))
    return [name for name in ordered if old.get(name) != new.get(name)
            or (name in old) != (name in new)]


def model_identity(model: str, revision: Any = None, tokenizer_revision: Any = None) -> dict:
    """What identifies a model: a local directory by its contents, anything else (a hub id, a
    URL) by its name and revisions."""
    path = Path(model).expanduser()
    if "://" not in model and path.is_dir():
        return {"local": _directory_identity(path)}
    if "://" not in model and path.is_file():
        return {"local_file": {"name": path.name, "size": path.stat().st_size}}
    # Never the URL's userinfo or query string: a new presigned signature is the same model.
    return {"id": sanitize_url(model), "revision": revision,
            "tokenizer_revision": tokenizer_revision}


def _directory_identity(path: Path) -> dict:
    config_file = path / "config.json"
    config: Any = None
    if config_file.is_file():
        data = config_file.read_bytes()
        try:
            config = json.loads(data)  # parsed: re-indenting the file is not a new model
        except ValueError:
            config = {"sha256": hashlib.sha256(data).hexdigest()}
    weights = {}
    for pattern in WEIGHT_PATTERNS:
        for file in path.rglob(pattern):
            rel = file.relative_to(path)
            if file.is_file() and not any(part.startswith(".") for part in rel.parts):
                weights[rel.as_posix()] = file.stat().st_size
    tokenizer = {}
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            tokenizer[name] = _file_sha256(file)
    return {"config": config, "weights": dict(sorted(weights.items())), "tokenizer": tokenizer}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


__all__ = ["FINGERPRINT_VERSION", "COMPONENTS", "THROUGHPUT_ENGINE_KEYS", "spec_fingerprint",
           "describe_changes", "model_identity"]
