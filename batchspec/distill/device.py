"""Where distill trains: ``--device auto|cpu|cuda``, one rule for the draft and the head.

``auto`` is CUDA where torch sees a GPU (:func:`cuda_available`), else the CPU; ``cuda`` where
there is none is refused before any work (SpecError naming ``--device``, exit 2). On CUDA:

- the target's features come from a bf16 forward pass on the GPU, in passes of
  :func:`feature_rows` sequences, sized to the memory free once the target is loaded;
- the draft and the head train under bf16 autocast with fp32 master weights (:func:`autocast`);
- before the target (or the model to train) is loaded, :func:`wait_for_gpu_memory` waits until
  ``torch.cuda.mem_get_info`` shows the memory of the vLLM engine that generated the
  continuations free again, and says so in a progress line;
- :data:`~batchspec.distill.train.MAX_TORCH_THREADS` applies only on the CPU (:func:`cpu_threads`).

torch is imported inside each call, so that checking the options imports it only for
``--device cuda``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from batchspec.errors import RuntimeFailure, SpecError

#: The choices of ``--device``.
DEVICES = ("auto", "cpu", "cuda")

#: Of the GPU memory free once the target is loaded, the share one forward pass may use (the
#: rest: the caching allocator's fragments, the CUDA context's growth).
FREE_SHARE = 0.8

#: What a forward pass holds per token besides the kept layers' states, in units of the hidden
#: width: the residual stream, the normed input and its fp32 upcast, queries, keys and values,
#: the attention's output, and the MLP's gate, up and product (3.5 widths each in a Llama),
#: with room to spare.
WORK_WIDTHS = 24

#: Bytes the target's logits may take at a time: the labels (their argmax) are computed over
#: this many bytes of logits at once, whatever the batch (:func:`label_rows`).
LOGIT_BYTES = 256 << 20

#: GPU memory kept free beyond the weights before the target is loaded: the first pass's room.
FORWARD_RESERVE = 1 << 30

#: How long to wait for the generating engine's GPU memory to come free, and how often to look.
GPU_FREE_TIMEOUT_S = 120.0
GPU_FREE_POLL_S = 0.5

Say = Callable[[str], None]


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``)
    where torch can: the plain check initialises the CUDA driver in this process, and a vLLM
    engine started after it (distill's generation) may fork its workers, which cannot use CUDA
    then. False without torch (the training that needs it says so)."""
    try:
        import torch
    except ImportError:
        return False
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return bool(torch.cuda.is_available())
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def resolve(asked: str, available: Callable[[], bool] | None = None) -> str:
    """``"cuda"`` or ``"cpu"`` for ``--device asked``: auto takes CUDA where it is available;
    ``cuda`` where it is not is a SpecError naming ``--device`` (exit 2)."""
    if asked not in DEVICES:
        raise SpecError("--device", f"expected one of {', '.join(DEVICES)}, got {asked!r}")
    if asked == "cpu":
        return "cpu"
    have = (available or cuda_available)()
    if asked == "cuda" and not have:
        raise SpecError(
            "--device",
            "cuda: torch sees no CUDA device here (torch.cuda.is_available() is false: no NVIDIA "
            "GPU, or a CPU build of torch); give --device cpu, or auto to use a GPU only where "
            "there is one",
        )
    return "cuda" if have else "cpu"


def feature_rows(free_bytes: int, hidden: int, layers_kept: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """Sequences of ``seq_len`` tokens one forward pass of the target takes, given
    ``free_bytes`` of GPU memory free once its weights are loaded: each sequence holds its kept
    layers' states (``layers_kept`` x ``hidden``) and the pass's working set
    (:data:`WORK_WIDTHS` x ``hidden``) at every token, in ``dtype_bytes``; the labels' logits
    (:data:`LOGIT_BYTES`) come off the top and :data:`FREE_SHARE` of the rest is used. At least 1."""
    per_row = max(1, seq_len) * hidden * dtype_bytes * (layers_kept + WORK_WIDTHS)
    budget = int(free_bytes * FREE_SHARE) - LOGIT_BYTES
    return max(1, budget // per_row)


def label_rows(vocab: int, seq_len: int) -> int:
    """Sequences whose logits (fp32, ``vocab`` per token) fit :data:`LOGIT_BYTES`: the labels
    are computed that many sequences at a time. At least 1."""
    return max(1, LOGIT_BYTES // (max(1, seq_len) * vocab * 4))


def weight_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """The bytes a model directory's weights take in a ``dtype_bytes`` type: its safetensors
    files' elements, counted from their headers (no tensor is read)."""
    from safetensors import safe_open

    elements = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                elements += count
    return elements * dtype_bytes


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f}"


def wait_for_gpu_memory(
    needed: int,
    what: str,
    say: Say,
    timeout_s: float | None = None,
    poll_s: float | None = None,
) -> tuple[int, int]:
    """Wait until ``torch.cuda.mem_get_info`` shows ``needed`` bytes free (the vLLM engine that
    generated the continuations is shut down before this is called; its process can take a
    moment to hand its memory back), say so, and return (free, total). A RuntimeFailure (exit
    1) when the memory stays taken for ``timeout_s`` (:data:`GPU_FREE_TIMEOUT_S`): another
    process holds it."""
    import torch

    timeout_s = GPU_FREE_TIMEOUT_S if timeout_s is None else timeout_s
    poll_s = GPU_FREE_POLL_S if poll_s is None else poll_s
    started = time.monotonic()
    while True:
        free, total = torch.cuda.mem_get_info()
        if free >= needed:
            say(
                f"GPU memory: {_gib(free)} of {_gib(total)} GiB free, the generating engine shut "
                f"down: loading {what} ({_gib(needed)} GiB wanted)"
            )
            return free, total
        if time.monotonic() - started >= timeout_s:
            raise RuntimeFailure(
                f"--device cuda: only {_gib(free)} of the GPU's {_gib(total)} GiB came free within "
                f"{timeout_s:.0f}s of the generating engine's shutdown, and {what} needs about "
                f"{_gib(needed)} GiB: another process holds the GPU (nvidia-smi shows which); "
                "free it, or give --device cpu"
            )
        time.sleep(poll_s)


def release_gpu() -> None:
    """Hand the GPU memory this process's allocator caches back to the driver (after the
    target's pass and after training), so that the evaluation's vLLM engine finds it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def autocast(device: str):
    """bf16 autocast on CUDA (the weights stay fp32: the master copy the optimiser updates);
    nothing on the CPU."""
    import torch

    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_threads(device: str, most: int) -> Iterator[None]:
    """On the CPU, at most ``most`` torch threads while the block runs (the machine is shared
    with the engine's processes); on CUDA, torch's own threads are left as they are."""
    import torch

    if device != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(most, threads)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
