"""``batchspec distill --device``, tested without a GPU: the choice (auto takes CUDA where torch
sees it; cuda where there is none exits 2 naming --device before any work), the forward passes
sized from given free-memory figures, the torch thread cap on the CPU only, and, with torch's
CUDA calls replaced by recorders, the generating engine shut down and its GPU memory seen free
before the target (or the draft) is loaded, said in a progress line."""

from __future__ import annotations

import logging
import os
import random
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from domain_data import write_shards
from helpers.jobs import ENGINE, MODELS, write_job

from batchspec.distill import data as distill_data
from batchspec.distill import device as devices
from batchspec.distill import features
from batchspec.distill import train as distill_train
from batchspec.distill.options import DistillOptions
from batchspec.distill.outdir import work_dir
from batchspec.distill.session import check_options, distill
from batchspec.errors import RuntimeFailure, SpecError
from batchspec.spec.load import load_spec

pytestmark = pytest.mark.vllm

GIB = 1 << 30


def _job(tmp: Path, rows: int = 12) -> Path:
    write_shards(tmp / "prompts", rows=rows, shards=1, seed=5)
    return write_job(
        tmp / "job.yaml",
        input={"path": str(tmp / "prompts" / "*.parquet"), "prompt_column": "prompt", "id_column": "id"},
        output={"path": str(tmp / "run-out")},
        model={"target": str(MODELS / "target"), "engine": dict(ENGINE)},
        speculative=None,
        sampling={"temperature": 0.0, "max_tokens": 8},
    )


# --------------------------------------------------------------------------- the choice


def test_auto_takes_cuda_where_torch_sees_it_and_cpu_asks_nothing():
    assert devices.resolve("auto", available=lambda: True) == "cuda"
    assert devices.resolve("auto", available=lambda: False) == "cpu"
    assert devices.resolve("cuda", available=lambda: True) == "cuda"
    assert devices.resolve("cpu", available=lambda: pytest.fail("cpu asks no GPU")) == "cpu"
    with pytest.raises(SpecError) as err:
        devices.resolve("tpu")
    assert err.value.key == "--device"


def test_the_check_asks_torch_through_nvml_and_leaves_the_environment(monkeypatch):
    seen = []
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(
        "torch.cuda.is_available", lambda: seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
    )
    devices.cuda_available()
    assert seen == ["1"] and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ


def test_cuda_where_there_is_none_exits_2_naming_device_before_any_work(tmp_path, monkeypatch):
    from batchspec.cli.distill import distill_command

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # what the command sets up for itself, undone after the test (it runs in this process)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    ours = logging.getLogger("batchspec")
    monkeypatch.setattr(ours, "handlers", list(ours.handlers))
    monkeypatch.setattr(ours, "level", ours.level)
    job = _job(tmp_path, rows=4)
    out = tmp_path / "new-draft"
    with pytest.raises(SpecError) as err:
        check_options(load_spec(job), DistillOptions(out=out, init="target", device="cuda"))
    assert err.value.key == "--device" and "--device cpu" in str(err.value)
    result = CliRunner().invoke(
        distill_command, [str(job), "--init", "target", "--out", str(out), "--device", "cuda"]
    )
    assert result.exit_code == 2, result.output
    assert "--device" in result.stderr and "torch.cuda.is_available() is false" in result.stderr
    assert not out.exists() and not work_dir(out).exists()


# --------------------------------------------------------------------------- sizing


def test_forward_passes_are_sized_from_the_free_memory():
    # an 8B Llama's width (4096), 3 layers kept, 512 tokens, 80 GiB free beside the weights:
    # each sequence holds (3 + 24) x 4096 x 512 tokens x 2 bytes = 108 MiB; 80% of 80 GiB less
    # the logits' 256 MiB holds 604 of them
    assert devices.feature_rows(80 * GIB, 4096, 3, 512) == (int(80 * GIB * 0.8) - (256 << 20)) // (
        27 * 4096 * 512 * 2
    )
    assert devices.feature_rows(80 * GIB, 4096, 3, 512) == 604
    # a 1B one (2048 wide) on 16 GiB: 237; the same at 128 tokens: four times as many
    assert devices.feature_rows(16 * GIB, 2048, 3, 512) == 237
    assert devices.feature_rows(16 * GIB, 2048, 3, 128) == 951
    # more layers kept, fewer sequences; no room at all still runs one at a time
    assert devices.feature_rows(16 * GIB, 2048, 6, 512) < devices.feature_rows(16 * GIB, 2048, 3, 512)
    assert devices.feature_rows(0, 4096, 3, 512) == 1 and devices.feature_rows(GIB // 4, 4096, 3, 512) == 1
    # the labels: a 128k vocabulary's fp32 logits at 512 tokens are 256 MiB a sequence
    assert devices.label_rows(128 * 1024, 512) == 1 and devices.label_rows(2048, 512) == 64


def test_a_chunk_runs_in_the_passes_the_memory_allows_with_the_same_features(monkeypatch, models):
    rng = random.Random(0)
    seqs = [[1, *(rng.randrange(3, 2000) for _ in range(n))] for n in (20, 9, 14, 20, 5)]
    ids = features_ids(seqs)
    target = features.Target(str(MODELS / "target"))
    whole_aux, whole_labels = target.features(*ids, [1, 2, 3])
    passes = []
    real = features.forward_pass
    monkeypatch.setattr(
        features,
        "forward_pass",
        lambda model, i, m, aux: (passes.append(i.shape[0]), real(model, i, m, aux))[1],
    )
    monkeypatch.setattr(features.Target, "rows_per_pass", lambda self, width, kept: 2)
    aux, labels = target.features(*ids, [1, 2, 3])
    assert passes == [2, 2, 1]
    assert (labels == whole_labels).all() and (aux.float() - whole_aux.float()).abs().max() < 1e-3
    assert aux.shape == (5, 21, 3 * 256) and str(aux.dtype) == "torch.float16"


def features_ids(seqs):
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def test_torch_threads_are_capped_on_the_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr("torch.get_num_threads", lambda: 16)
    monkeypatch.setattr("torch.set_num_threads", calls.append)
    with devices.cpu_threads("cuda", 2):
        pass
    assert calls == []
    with devices.cpu_threads("cpu", 2):
        assert calls == [2]
    assert calls == [2, 16]


def test_cuda_trains_in_bf16_autocast_and_the_cpu_in_fp32():
    import torch

    with warnings.catch_warnings():  # "CUDA is not available ... Disabling autocast" here
        warnings.simplefilter("ignore")
        assert devices.autocast("cuda").fast_dtype == torch.bfloat16
    assert not isinstance(devices.autocast("cpu"), torch.autocast)


# --------------------------------------------------------------------------- the order of calls


class _Stop(Exception):
    """Ends the run where the test has seen what it needs."""


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA calls and the engine replaced by recorders; the GPU memory comes free on
    the second look after the engine's shutdown."""
    calls: list[str] = []
    free = iter([1 * GIB, 79 * GIB, 79 * GIB])

    def mem_get_info():
        calls.append("mem_get_info")
        return next(free), 80 * GIB

    class Engine:
        def __init__(self, spec):
            calls.append("engine started")

        def stream(self, rows, in_flight):
            for row in rows:
                yield (
                    row,
                    [
                        {
                            "error": None,
                            "prompt_token_ids": [1, 7, 9],
                            "output_token_ids": [5, 6, 7, 8],
                            "finish_reason": "length",
                        }
                    ],
                )

        def shutdown(self):
            calls.append("engine shut down")

    def load(*args, **kwargs):
        calls.append("target loaded")
        raise _Stop

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.mem_get_info", mem_get_info)
    monkeypatch.setattr(devices, "GPU_FREE_POLL_S", 0.01)
    monkeypatch.setattr(distill_data, "TokenEngine", Engine)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", load)
    return calls


def test_the_engine_is_shut_down_and_its_memory_seen_free_before_the_target_loads(
    models, tmp_path, fake_cuda
):
    said: list[str] = []
    opts = DistillOptions(
        out=tmp_path / "head", method="eagle3", device="cuda", sample=12, heldout=2, steps=2, evaluate=False
    )
    with pytest.raises(_Stop):
        distill(load_spec(_job(tmp_path)), opts, said.append)
    assert fake_cuda == [
        "engine started",
        "engine shut down",
        "mem_get_info",
        "mem_get_info",
        "target loaded",
    ]
    gpu = [line for line in said if line.startswith("GPU memory")]
    assert gpu == [
        "GPU memory: 79.0 of 80.0 GiB free, the generating engine shut down: loading the target in "
        f"bf16 for its hidden states ({(devices.weight_bytes(MODELS / 'target') + GIB) / GIB:.1f} GiB wanted)"
    ]
    assert any("forward pass on cuda" in line for line in said)


def test_the_draft_trains_on_cuda_once_the_engine_s_memory_is_free(models, tmp_path, fake_cuda, monkeypatch):
    import torch

    draft = torch.nn.Linear(4, 4)
    draft.config = SimpleNamespace(num_hidden_layers=1)
    monkeypatch.setattr(distill_train, "check_vocabulary", lambda target, draft, key="--draft": None)
    monkeypatch.setattr(distill_train, "load_draft", lambda path: draft)

    def train_draft(*args, **kwargs):
        fake_cuda.append(f"draft trained on {kwargs['device']}")
        raise _Stop

    monkeypatch.setattr(distill_train, "train_draft", train_draft)
    opts = DistillOptions(
        out=tmp_path / "d", draft=str(MODELS / "draft"), device="cuda", sample=12, heldout=2, force=True
    )
    said: list[str] = []
    with pytest.raises(_Stop):
        distill(load_spec(_job(tmp_path)), opts, said.append)
    assert fake_cuda == [
        "engine started",
        "engine shut down",
        "mem_get_info",
        "mem_get_info",
        "draft trained on cuda",
    ]
    assert any(line.startswith("GPU memory: 79.0 of 80.0 GiB free") for line in said)


def test_memory_that_never_comes_free_is_an_error_naming_the_option(monkeypatch):
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (2 * GIB, 80 * GIB))
    with pytest.raises(RuntimeFailure) as err:
        devices.wait_for_gpu_memory(10 * GIB, "the target", print, timeout_s=0.05, poll_s=0.01)
    assert "--device cuda" in str(err.value) and "2.0 of the GPU's 80.0 GiB" in str(err.value)
