"""Runtime fixes for vLLM's CPU build, loaded by vLLM itself as a ``vllm.general_plugins`` entry
point (see ``pyproject.toml`` and docs/vllm-cpu-rejection-sampler.md).

vLLM's CPU platform starts its engine and worker processes with spawn, so a monkeypatch in the
batchspec process never reaches them. vLLM loads general plugins in every process it starts, and
in the worker it does so before it registers the CPU replacements of its Triton kernels, which
is the moment these fixes need:

1. **Rejection sampler** (``expand``): ``vllm/utils/cpu_triton_utils.py``'s
   ``_expand_kernel_impl`` hands the C++ op an int64 copy of its float output and never copies
   it back (and truncates the float input to int64). The rejection sampler expands per-request
   temperature, top_k and top_p to per-token tensors through it, so with speculative decoding
   every batch that holds a sampled request divides its logits by uninitialised memory: sampled
   requests get a wrong distribution and greedy requests batched with them get wrong tokens.
   The fix replaces it with the same expansion written with ``repeat_interleave``.
2. **Seeded requests and chunked prefill** (``seed``): for a request whose prompt is split over
   steps, vLLM samples a token it then discards and rewinds the request's generator with
   ``generator.set_offset(...)``, which a CPU generator refuses ("CPU Generator does not use
   offset"): the engine dies. The fix saves the generator state of those requests before
   sampling and restores it afterwards (what the rewind means: a discarded sample consumes no
   randomness), and hides those generators from vLLM's CUDA-only rewind.

3. **LoRA rows batched with base-model rows** (``lora``): the CPU build's LoRA kernels
   (``vllm/lora/ops/torch_ops/lora_ops.py``) pick each token's adapter weights with
   ``weights[indices]``, and a token of a request without an adapter has index -1, which torch
   reads as the last adapter slot: a base-model row batched with adapter rows runs with one of
   their adapters. The fix writes the same kernels with a -1 token's LoRA term zero, as vLLM's
   Triton kernels skip it.

4. **Engines in the calling process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): registering the
   kernel overrides scans every loaded module's values and calls ``hasattr(value, "__dict__")``
   and ``vars(value).get`` on each (``_rebind_kernels`` in ``vllm/triton_utils/dispatcher.py``).
   A value whose attribute access raises (Flask's ``request`` and ``g`` proxies, loaded by a
   moto server in the process) or whose ``__dict__`` is no mapping (``llvmlite.binding.ffi.lib``,
   loaded once an n-gram engine has imported numba) makes the scan raise, and the engine fails
   to start. The fix takes such values out of their modules while the overrides are registered
   (a fraction of a second, in the thread that starts the engine) and puts them back.

All act only on vLLM's CPU build and on the vLLM versions they were checked against
(:data:`CHECKED_VLLM_VERSIONS`); anywhere else the plugin does nothing and says so at debug level.
Drop this module and its entry point once the vLLM version batchspec pins has the upstream fix
(vLLM issue #55005, PR #55006).

The batchspec process asks :func:`active` whether engines it starts get the fixes. On every
platform, the plugin also makes each engine process die with its parent
(:mod:`batchspec.engine.lifeline`), and installs the tests' fault (:mod:`batchspec.engine.faults`:
nothing unless its variable is set)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)


#: The entry point's name in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` lists).
PLUGIN_NAME = "batchspec"


#: The entry point's target.
PLUGIN_TARGET = f"{__name__}:register"


#: vLLM versions whose CPU build has these bugs and on which the fixes were checked.
CHECKED_VLLM_VERSIONS = frozenset({"0.32.0"})


#: Set to 1 (true, yes) to turn the plugin off, e.g. to reproduce the bugs it works around.
DISABLE_ENV = "BATCHSPEC_DISABLE_VLLM_PLUGIN"


#: The kernel the rejection-sampler fix replaces (vLLM's dispatcher name for it).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


_applied: set[str] = set()


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _gate() -> str | None:
    """Why the fixes must not be applied in this process (None: apply them)."""
    if _disabled_by_env():
        return f"turned off by {DISABLE_ENV}"
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed"
    if vllm.__version__ not in CHECKED_VLLM_VERSIONS:
        return (
            f"vLLM {vllm.__version__} is not a version the fixes were checked against "
            f"({', '.join(sorted(CHECKED_VLLM_VERSIONS))})"
        )
    # Imported here, not at module level: vLLM calls register() while it is still setting up,
    # and the batchspec process should not resolve vLLM's platform just by importing batchspec.
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"not vLLM's CPU build (platform: {type(current_platform).__name__})"
    return None


def inactive_reason() -> str | None:
    """Why engines started from this process would not get the fixes, or None if they would.

    Besides the gate :func:`register` applies in vLLM's processes, checks that vLLM can find
    the plugin at all: the entry point is installed and ``VLLM_PLUGINS`` does not leave it out."""
    reason = _gate()
    if reason is not None:
        return reason
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} does not list {PLUGIN_NAME!r}"
    registered = [
        ep
        for ep in metadata.entry_points(group="vllm.general_plugins")
        if ep.name == PLUGIN_NAME and ep.value == PLUGIN_TARGET
    ]
    if not registered:
        return (
            "batchspec's vllm.general_plugins entry point is not installed "
            "(reinstall batchspec: pip install -e .)"
        )
    return None


def active() -> bool:
    """True if vLLM engines started from this process run with the CPU fixes."""
    return inactive_reason() is None


def register() -> None:
    """The entry point vLLM calls in each of its processes; may be called more than once."""
    if "lifeline" not in _applied:  # on every platform: not a fix of the CPU build's
        from batchspec.engine.lifeline import hold

        hold()
        _applied.add("lifeline")
    if "fault" not in _applied:  # test-only, off unless its variable is set
        from batchspec.engine.faults import install

        install()
        _applied.add("fault")
    reason = _gate()
    if reason is not None:
        log.debug("batchspec vLLM plugin does nothing: %s", reason)
        return
    if "expand" not in _applied:
        _fix_expand_kernel()
        _applied.add("expand")
    if "seed" not in _applied:
        _hook_worker_init()
        _applied.add("seed")


# ------------------------------------------------------------------ 1. rejection sampler


def expand_kernel_impl(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,
) -> None:  # noqa: N803
    """What vLLM's Triton ``expand_kernel`` does, in torch: request ``i``'s value (``replace_to``
    where it equals ``replace_from``) written to its tokens ``cu[i-1]:cu[i]`` of ``output``, in
    ``output``'s own dtype. Same parameters as ``cpu_triton_utils._expand_kernel_impl``, which
    vLLM's kernel dispatcher passes positionally."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def _fix_expand_kernel() -> None:
    # The worker registers cpu_triton_utils' functions as kernel overrides right after loading
    # plugins, reading them from the module: replacing the module attribute is enough there.
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    # Where the overrides are already registered (plugins loaded late), rebind the kernel too.
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    log.debug("batchspec vLLM plugin: CPU rejection sampler's expand kernel replaced")


# ------------------------------------------------------------------ 2. seeded chunked prefill
# (and 4: the kernel overrides registered again in one process)


def _hook_worker_init() -> None:
    # The model runner is worker-only code that takes seconds to import: patch it when the worker
    # registers its kernel overrides (right after loading plugins, before it builds the runner)
    # rather than in every process that loads plugins.
    from vllm.platforms import current_platform

    platform = type(current_platform)
    register_overrides = platform.register_triton_kernel_overrides.__func__

    def register_triton_kernel_overrides(cls) -> None:
        with _unscannable_values_hidden():
            register_overrides(cls)
        _patch_cpu_model_runner()
        _fix_lora_ops()

    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


def _scannable(value: Any) -> bool:
    """Whether vLLM's kernel rebind scan can read ``value`` (see fix 4)."""
    try:
        return not hasattr(value, "__dict__") or isinstance(vars(value), Mapping)
    except Exception:
        return False


@contextmanager
def _unscannable_values_hidden() -> Iterator[None]:
    """Module values vLLM's kernel rebind scan cannot read, out of their modules meanwhile."""
    hidden = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if not _scannable(value):
                hidden.append((namespace, name, value))
                del namespace[name]
    try:
        yield
    finally:
        for namespace, name, value in hidden:
            namespace.setdefault(name, value)


def _discarded_generators(runner) -> dict[int, Any]:
    """{request index: generator} of seeded requests whose sampled token vLLM will discard
    (a prompt chunk that is not the last one)."""
    import numpy as np

    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discarded = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return {int(i): generators[int(i)] for i in discarded if int(i) in generators}


def _patch_cpu_model_runner() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_batchspec_seed_fix", False):
        return
    sample = CPUModelRunner._sample
    bookkeeping_sync = CPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        # A discarded sample must not advance its request's generator, or a seeded request's
        # output would depend on how the scheduler happened to chunk its prompt.
        saved = {i: gen.get_state() for i, gen in _discarded_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        # vLLM rewinds these generators with set_offset (CUDA only); _sample already restored
        # them, so take them out of its sight for this call.
        hidden = _discarded_generators(self)
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    CPUModelRunner._batchspec_seed_fix = True
    log.debug("batchspec vLLM plugin: CPU model runner keeps seeded generators on chunked prefill")


# ------------------------------------------------------------------ 3. LoRA and base rows


def _lora_term(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """Each token's ``inputs @ weights[index].T``, zero for a token without an adapter (-1)."""
    import torch

    keep = indices >= 0
    selected = weights[indices.clamp(min=0)].to(dtype=dtype)
    if selected.dim() == 4:
        selected = selected.squeeze(dim=1)
    term = torch.einsum("bi, boi -> bo", inputs.to(dtype=dtype), selected)
    return torch.where(keep[:, None], term, torch.zeros((), dtype=dtype))


def bgmv_shrink(
    inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any, scaling: float = 1.0
) -> None:
    """vLLM's ``bgmv_shrink`` (torch ops), a token without an adapter getting zero."""
    term = _lora_term(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : term.shape[1]] = scaling * term


def bgmv_expand(
    inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any, add_inputs: bool = True
) -> None:
    """vLLM's ``bgmv_expand`` (torch ops), a token without an adapter adding nothing."""
    term = _lora_term(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if term.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(term.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += term[:limit, :common]
    else:
        output_tensor[:, :common] = term[:limit, :common]


def bgmv_expand_slice(
    inputs: Any,
    lora_b_weights: Any,
    output_tensor: Any,
    lora_indices_tensor: Any,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """vLLM's ``bgmv_expand_slice`` (torch ops), a token without an adapter adding nothing."""
    term = _lora_term(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += term
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = term


_LORA_OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def _fix_lora_ops() -> None:
    # lora_ops' sgmv_* call its bgmv_* by module global; the package re-exports them, and the
    # CPU punica wrapper imports them by name (rebound too where it is already imported).
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops

    modules = [lora_ops, torch_ops, sys.modules.get("vllm.lora.punica_wrapper.punica_cpu")]
    for module in modules:
        for name, fn in _LORA_OPS.items():
            if module is not None and hasattr(module, name):
                setattr(module, name, fn)
    log.debug("batchspec vLLM plugin: CPU LoRA kernels skip tokens without an adapter")
