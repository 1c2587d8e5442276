"""What shapes a job's output, hashed per component, so that a rerun with a different spec
cannot mix its rows with the old ones silently.

Store ``{"fingerprint_version": FINGERPRINT_VERSION, "fingerprint": spec_fingerprint(spec)}``
beside the output; on a rerun, :func:`describe_changes` names the components that differ.
Components (each a 16-hex-digit prefix of the SHA-256 of a canonical JSON):

- ``model.target``: the target model's identity. For a local directory, its contents: the
  parsed ``config.json``, and the SHA-256 of every weight file (``*.safetensors`` and ``*.bin``
  anywhere under it outside hidden folders, ``*.pt`` at its top, as vLLM loads them) and of the
  tokenizer, chat-template, generation-config, weight-index and processor files
  (:data:`MODEL_FILES`), plus the top-level ``*.py`` files when a config names custom code
  (``auto_map``). Not the directory's path: a copy of the model elsewhere is the same model; a
  draft retrained in place is a new one, even with files of the same names and sizes. A single
  model file (a GGUF) by its name and SHA-256. For a hub id or URL: the id (URL sanitised)
  plus ``model.engine.revision`` and ``tokenizer_revision``.
- ``model.lora``: each LoRA adapter's identity by name (a local adapter by its contents, as a
  local model: its config and weights; an id by the id) and the job-wide adapter; absent
  without ``model.lora``, so a job without adapters keeps the hashes it had.
- ``speculative.model``: the draft's identity, the same way with ``speculative.revision``;
  absent when there is no draft model (speculation off, or ngram/suffix methods).
- ``speculative``: the speculative section without ``model`` (null when speculation is off);
  ``{"method": "auto"}`` for ``speculative: auto`` whatever its drafts and whatever it chooses:
  greedy rows are the same text with any choice (speculative decoding is lossless), and sampled
  rows come from the target's own distribution with any choice, though not the same draws.
- ``model.engine``: every engine argument except :data:`THROUGHPUT_ENGINE_KEYS` (speed, memory,
  parallelism and logging knobs that leave the text unchanged) and credentials (``hf_token``).
  A key in neither list counts, so an argument vLLM adds later is assumed to shape the output;
  its value is taken from the public view, so a string under a key that view does not know to
  be harmless (:data:`batchspec.redact.ENGINE_STRING_KEYS`) counts by presence only. Counted
  on purpose: dtype, max_model_len, quantization, kv_cache_dtype (it changes numerics),
  tokenizer, tokenizer_mode, revision, seed, trust_remote_code, hf_overrides, generation_config,
  override_generation_config, ...; and ``model.reasoning_parser`` where set.
- ``sampling``: the SamplingParams arguments.
- ``columns``: ``input.prompt_column``, ``messages_column``, ``id_column``,
  ``sampling_columns``, ``lora_column`` (where set), ``output.keep_columns``, ``input.filter``
  (where set), ``input.prompt_template``, ``messages_template`` and ``pair_templates`` (where
  set: their wording), a pooling task's ``input.pair_columns``, ``input.image_columns`` and
  the image limits (where image columns are set),
  ``output.parse_json`` (where true) and ``input.format`` where it is ``openai`` (its lines
  name their own prompt, id and sampling).

Secrets never enter a component: storage options are not components, and the engine arguments
are hashed from :func:`batchspec.redact.public_spec`'s view.

Hashing a file reads it once (about 1.5 GB/s with SHA-NI, so seconds for a 16 GB model, bound
by the disk); the digest is then cached per user (:class:`DigestCache`, in
``$XDG_CACHE_HOME/batchspec`` or ``~/.cache/batchspec``) keyed by the file's real path, size,
mtime, ctime, inode and device, so a rerun stats the files instead of reading them. Any write
to a file moves its mtime and ctime (tools that restore the mtime, ``cp -p``, ``rsync -t``,
``touch -d``, still move the ctime, which only the kernel sets), so a changed file is hashed
again; a file changed within two seconds of being hashed is not cached (a filesystem with
coarse timestamps could not tell a second write from the first). Without a writable cache
directory every run hashes again: slower, never wrong.

Version 1 identified weight files by name and size only: a record written under it names a
local model as changed (its bytes cannot be proven the same), and one ``--overwrite`` rewrites
it under version 2."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from batchspec.redact import is_secret_key, public_spec, sanitize_url
from batchspec.spec.model import JobSpec

log = logging.getLogger(__name__)


#: Bump when what a component covers changes, so old and new fingerprints can be told apart.
FINGERPRINT_VERSION = 2


#: Component names, in the order :func:`describe_changes` reports them.
COMPONENTS = (
    "model.target",
    "model.lora",
    "speculative.model",
    "speculative",
    "model.engine",
    "sampling",
    "columns",
)


#: Engine arguments that change speed, memory or logging but not the generated text.
THROUGHPUT_ENGINE_KEYS = frozenset(
    {
        # batching and scheduling
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "long_prefill_token_threshold",
        "long_prefill_token_threshold_adaptive",
        "enable_chunked_prefill",
        "scheduling_policy",
        "scheduler_cls",
        "async_scheduling",
        "stream_interval",
        "max_num_active_seqs",
        "max_num_queued_reqs",
        "max_num_queued_tokens",
        "max_num_scheduled_tokens",
        "prefill_schedule_interval",
        "enable_dbo",
        "dbo_decode_token_threshold",
        "dbo_prefill_token_threshold",
        "ubatch_size",
        # memory and caches
        "gpu_memory_utilization",
        "swap_space",
        "cpu_offload_gb",
        "kv_cache_memory_bytes",
        "num_gpu_blocks_override",
        "block_size",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "prefix_cache_retention_interval",
        "enable_sleep_mode",
        "sleep_mode_offload_cudagraph",
        "enable_cumem_allocator",
        "kv_offloading_backend",
        "kv_offloading_size",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_shm_cache_max_object_size_mb",
        "offload_backend",
        "offload_group_size",
        "offload_num_in_group",
        "offload_prefetch_step",
        "offload_params",
        # compilation and kernels' launch mode
        "enforce_eager",
        "compilation_config",
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        "optimization_level",
        # parallelism and placement
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "data_parallel_size_local",
        "data_parallel_rank",
        "data_parallel_start_rank",
        "data_parallel_address",
        "data_parallel_rpc_port",
        "data_parallel_backend",
        "data_parallel_external_lb",
        "data_parallel_hybrid_lb",
        "distributed_executor_backend",
        "disable_custom_all_reduce",
        "max_parallel_loading_workers",
        "master_addr",
        "master_port",
        "nnodes",
        "node_rank",
        "numa_bind",
        "numa_bind_cpus",
        "numa_bind_nodes",
        "device_ids",
        "distributed_timeout_seconds",
        "cpu_distributed_timeout_seconds",
        "worker_cls",
        "worker_extension_cls",
        # loading speed, logging, metrics, process management
        "download_dir",
        "use_tqdm_on_load",
        "safetensors_load_strategy",
        "safetensors_prefetch_block_size",
        "safetensors_prefetch_num_threads",
        "disable_log_stats",
        "disable_log_requests",
        "enable_log_requests",
        "aggregate_engine_logging",
        "enable_logging_iteration_details",
        "log_level",
        "log_config_file",
        "logging_config",
        "kv_cache_metrics",
        "kv_cache_metrics_sample",
        "cudagraph_metrics",
        "enable_mfu_metrics",
        "enable_mm_processor_stats",
        "collect_detailed_traces",
        "otlp_traces_endpoint",
        "show_hidden_metrics_for_version",
        "profiler_config",
        "per_request_spec_decode_metrics",
        "shutdown_timeout",
        "served_model_name",
        "renderer_num_workers",
        "jit_monitor_mode",
        "jit_monitor_verbose",
        "enable_layerwise_nvtx_tracing",
        "ray_workers_use_nsight",
    }
)


#: Files of a local model directory hashed whole: they decide how text becomes tokens, how chat
#: messages are rendered, which sampling defaults vLLM applies and which weight files it loads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


MODEL_FILES = TOKENIZER_FILES + (
    "tekken.json",
    "params.json",
    "preprocessor_config.json",
    "processor_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "consolidated.safetensors.index.json",
    # a LoRA adapter's rank, alpha and target modules
    "adapter_config.json",
)


#: Weight files, hashed whole, anywhere under the directory (outside hidden folders) ...
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


#: ... and at its top only (vLLM's fallback format; training checkpoints below keep optimizer
#: state in ``*.pt`` files vLLM never reads).
TOP_WEIGHT_PATTERNS = ("*.pt",)


def spec_fingerprint(spec: JobSpec) -> dict[str, str]:
    """Component name -> short SHA-256 (16 hex digits) of what that part of the spec means for
    the output; see the module docstring for the components."""
    engine = spec.model.engine
    cache = DigestCache()
    components: dict[str, Any] = {
        "model.target": model_identity(
            spec.model.target, engine.get("revision"), engine.get("tokenizer_revision"), cache=cache
        ),
    }
    lora = spec.model.lora
    if lora is not None:
        # what a row's adapter is, by its contents: the same name on other weights is a change
        components["model.lora"] = {
            "adapters": {name: model_identity(source, cache=cache) for name, source in lora.adapters.items()},
            "adapter": lora.adapter,
        }
    speculative = spec.speculative
    if speculative is not None and speculative.get("model"):
        components["speculative.model"] = model_identity(
            str(speculative["model"]), speculative.get("revision"), None, cache=cache
        )
    cache.save()
    components["speculative"] = (
        {"method": "auto"}
        if spec.speculative_auto is not None
        else None
        if speculative is None
        else {k: v for k, v in speculative.items() if k != "model"}
    )
    # The public view: URLs sanitised, and a string under a key public_spec does not know to be
    # harmless counts as present (``***``) but not by its value.
    public_engine = public_spec({"model": {"engine": dict(engine)}})["model"]["engine"]
    components["model.engine"] = {
        k: v for k, v in public_engine.items() if k not in THROUGHPUT_ENGINE_KEYS and not is_secret_key(k)
    }
    if spec.model.reasoning_parser is not None:  # only when set: other jobs keep their hashes
        # the parser splits the thinking from the answer, and constrains the answer only
        components["model.engine"]["reasoning_parser"] = spec.model.reasoning_parser
    components["sampling"] = spec.sampling
    components["columns"] = {
        "prompt_column": spec.input.prompt_column,
        "messages_column": spec.input.messages_column,
        "id_column": spec.input.id_column,
        "sampling_columns": spec.input.sampling_columns,
        "keep_columns": None if spec.output.keep_columns is None else list(spec.output.keep_columns),
    }
    if spec.task != "generate":  # only when set: generation's outputs keep their hashes
        components["task"] = {"task": spec.task, "pooling": spec.pooling}
        components["columns"]["pair_columns"] = spec.input.pair_columns
        if spec.input.pair_templates is not None:  # only when set: their wording is the pair's
            components["columns"]["pair_templates"] = list(spec.input.pair_templates)
    if spec.input.lora_column:  # only when set: outputs of jobs without LoRA keep their hashes
        components["columns"]["lora_column"] = spec.input.lora_column
    if spec.input.prompt_template is not None:  # its wording is the prompt's: a change is a new spec
        components["columns"]["prompt_template"] = spec.input.prompt_template
    if spec.input.messages_template is not None:
        components["columns"]["messages_template"] = [dict(m) for m in spec.input.messages_template]
    if spec.input.image_columns:  # only when set: what the model sees, and which images are errors
        components["columns"]["images"] = {
            "image_columns": list(spec.input.image_columns),
            "max_image_bytes": spec.input.max_image_bytes,
            "max_image_pixels": spec.input.max_image_pixels,
        }
    if spec.output.parse_json:  # the typed answer column
        components["columns"]["parse_json"] = True
    if spec.input.filter is not None:  # a table's rows the job reads
        components["columns"]["filter"] = spec.input.filter
    from batchspec.io.input_formats import input_format

    if input_format(spec.input.format).self_describing:  # each line names its prompt, id, sampling
        components["columns"]["format"] = spec.input.format
        # and its model: the names the job serves decide which lines run and which are errors
        from batchspec.io.openai_batch import served_names

        components["columns"]["served_names"] = sorted(served_names(spec))
    from batchspec.io.output_formats import output_format

    if output_format(spec.output.format).in_fingerprint:  # Parquet outputs keep their hashes
        components["columns"]["output_format"] = spec.output.format
    return {name: _digest(value) for name, value in components.items()}


def describe_changes(old: dict, new: dict) -> list[str]:
    """The components whose hashes differ between two fingerprints (one present in only one of
    them counts as changed), in :data:`COMPONENTS` order, then any others sorted by name."""
    names = set(old) | set(new)
    ordered = [c for c in COMPONENTS if c in names] + sorted(names - set(COMPONENTS))
    return [name for name in ordered if old.get(name) != new.get(name) or (name in old) != (name in new)]


def model_identity(
    model: str, revision: Any = None, tokenizer_revision: Any = None, cache: DigestCache | None = None
) -> dict:
    """What identifies a model: a local directory or file by its contents (SHA-256 digests,
    cached in ``cache``; one of its own, saved before returning, when none is given), anything
    else (a hub id, a URL) by its name and revisions."""
    path = Path(model).expanduser()
    local = "://" not in model and (path.is_dir() or path.is_file())
    if not local:
        # Never the URL's userinfo or query string: a new presigned signature is the same model.
        return {"id": sanitize_url(model), "revision": revision, "tokenizer_revision": tokenizer_revision}
    own = cache is None
    cache = DigestCache() if cache is None else cache
    try:
        if path.is_dir():
            return {"local": _directory_identity(path, cache)}
        return {"local_file": {"name": path.name, "sha256": cache.digest(path)}}
    finally:
        if own:
            cache.save()


def _directory_identity(path: Path, cache: DigestCache) -> dict:
    config: Any = None
    custom_code = False
    config_file = path / "config.json"
    if config_file.is_file():
        data = config_file.read_bytes()
        try:
            config = json.loads(data)  # parsed: re-indenting the file is not a new model
        except ValueError:
            config = {"sha256": hashlib.sha256(data).hexdigest()}
        custom_code = isinstance(config, dict) and "auto_map" in config
    weights: dict[str, str] = {}
    for patterns, found in ((WEIGHT_PATTERNS, path.rglob), (TOP_WEIGHT_PATTERNS, path.glob)):
        for pattern in patterns:
            for file in found(pattern):
                rel = file.relative_to(path)
                if file.is_file() and not any(part.startswith(".") for part in rel.parts):
                    weights[rel.as_posix()] = cache.digest(file)
    files: dict[str, str] = {}
    for name in MODEL_FILES:
        file = path / name
        if file.is_file():
            files[name] = cache.digest(file)
    if not custom_code and "tokenizer_config.json" in files:
        try:
            custom_code = "auto_map" in json.loads((path / "tokenizer_config.json").read_bytes())
        except (ValueError, TypeError):
            pass
    identity = {"config": config, "weights": dict(sorted(weights.items())), "tokenizer": files}
    if custom_code:  # trust_remote_code runs these: they shape the output like weights do
        identity["code"] = {
            file.name: cache.digest(file) for file in sorted(path.glob("*.py")) if file.is_file()
        }
    return identity


# ---------------------------------------------------------------- content digests, cached


#: A file whose mtime or ctime is this recent (ns) when hashed is not cached: on a filesystem
#: with coarse timestamps a second same-size write in the same tick would look unchanged.
RACY_NS = 2_000_000_000


#: Entries kept in the cache file, the most recently used first.
CACHE_MAX_ENTRIES = 20_000


CACHE_FILE = "digests.json"


_CHUNK = 8 << 20  # 8 MiB reads: hashing, not system calls, is the cost


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/batchspec`` (when that is an absolute path), else
    ``~/.cache/batchspec``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "batchspec"


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


class DigestCache:
    """SHA-256 digests of files, kept across runs in a JSON file in :func:`cache_dir` (created
    0700; a directory another user owns or can write is never used), keyed by the file's real
    path and valid while its size, mtime, ctime, inode and device are unchanged.

    A missing, unreadable or corrupt cache file is treated as empty and rewritten; the file is
    replaced atomically (a temporary file renamed over it), merged with what other processes
    saved meanwhile, the last writer winning a race (a lost entry costs one rehash). Failing to
    write is never an error: the digests are still right, only the next run reads again."""

    def __init__(self, directory: Path | None = None):
        self.directory = cache_dir() if directory is None else Path(directory)
        self.entries: dict[str, dict] | None = None  # read on first use
        self.new: dict[str, dict] = {}

    # -- the public calls

    def digest(self, path: Path) -> str:
        """The SHA-256 of ``path``'s bytes (hex), from the cache when its stat still matches."""
        real = os.path.realpath(path)
        before = os.stat(real)
        key = _stat_key(before)
        entry = self.new.get(real) or self._load().get(real)
        if entry is not None and all(entry.get(k) == v for k, v in key.items()):
            if time.time() - entry.get("used", 0) > 86400:  # kept fresh, rewritten once a day
                self.new[real] = {**entry, "used": int(time.time())}
            return entry["sha256"]
        started = time.monotonic()
        digest = _hash_file(real)
        seconds = time.monotonic() - started
        if before.st_size >= 1 << 30:
            log.info(
                "hashed %s (%.1f GB) in %.1f s; cached for later runs", real, before.st_size / 1e9, seconds
            )
        after = os.stat(real)
        recent = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) < RACY_NS
        if _stat_key(after) == key and not recent:
            self.new[real] = {**key, "sha256": digest, "used": int(time.time())}
        return digest

    def save(self) -> None:
        """Write the digests learnt since the last save (nothing when there are none)."""
        if not self.new:
            return
        try:
            if not self._private_dir(create=True):
                return
            merged = {**self._read(), **self.new}
            if len(merged) > CACHE_MAX_ENTRIES:
                keep = sorted(merged, key=lambda k: merged[k].get("used", 0), reverse=True)
                merged = {k: merged[k] for k in keep[:CACHE_MAX_ENTRIES]}
            data = json.dumps({"version": 1, "entries": merged}, separators=(",", ":"))
            fd, tmp = tempfile.mkstemp(prefix=".digests-", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(data)
                os.replace(tmp, self.directory / CACHE_FILE)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            self.entries, self.new = merged, {}
        except OSError as exc:  # a read-only home, a full disk: the next run hashes again
            log.debug("digest cache not saved in %s: %s", self.directory, exc)

    # -- the file

    def _load(self) -> dict[str, dict]:
        if self.entries is None:
            self.entries = self._read() if self._private_dir(create=False) else {}
        return self.entries

    def _private_dir(self, create: bool) -> bool:
        """Whether the cache directory is this user's alone (made so, 0700, when it is ours)."""
        try:
            if create:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.stat(self.directory)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False
        if hasattr(os, "geteuid"):
            if st.st_uid != os.geteuid():
                return False  # someone else's: its digests could be planted
            if st.st_mode & 0o077:
                try:
                    os.chmod(self.directory, 0o700)
                except OSError:
                    return False
        return True

    def _read(self) -> dict[str, dict]:
        """The cache file's valid entries; anything unreadable or malformed counts as absent."""
        try:
            with open(self.directory / CACHE_FILE, "rb") as handle:
                data = json.loads(handle.read())
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("version") == 1 else None
        if not isinstance(entries, dict):
            return {}
        return {path: entry for path, entry in entries.items() if _valid_entry(entry)}


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    digest = entry.get("sha256")
    return (
        all(type(entry.get(k)) is int for k in ("size", "mtime_ns", "ctime_ns", "ino", "dev"))
        and isinstance(digest, str)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


def _hash_file(path: str) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
