"""batchspec: offline batch LLM inference over Parquet shards with vLLM speculative decoding.

The library, in one namespace::

    import batchspec

    spec = batchspec.load_spec("jobs/demo.yaml", ["output.path=out/library"])
    result = batchspec.run_job(spec, batchspec.RunOptions(worker_index=0, num_workers=1))
    print(result.summary["status"], result.summary["totals"]["rows"], "rows")
    print(batchspec.build_report(spec.output.path)["overall"]["acceptance_rate"])

Each name is imported on first use (``import batchspec`` stays cheap, and never imports vLLM):
the functions behind ``batchspec run``, ``validate``, ``status``, ``report``, ``tune`` and
``distill``, their options and results, the spec's types and the errors (each with the exit
code the command line exits with)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchspec.version import __version__

#: Each public name and the module it lives in.
_HOMES = {
    # the job spec
    "load_spec": "batchspec.spec.load",
    "build_spec": "batchspec.spec.build",
    "JobSpec": "batchspec.spec.model",
    "InputSpec": "batchspec.spec.model",
    "OutputSpec": "batchspec.spec.model",
    "ModelSpec": "batchspec.spec.model",
    "LoraSpec": "batchspec.spec.model",
    "ExecutionSpec": "batchspec.spec.model",
    "ExecutorSpec": "batchspec.spec.model",
    "AutoSpeculation": "batchspec.spec.model",
    # run, validate, status
    "run_job": "batchspec.run.job",
    "RunOptions": "batchspec.run.job",
    "RunResult": "batchspec.run.job",
    "validate_job": "batchspec.run.validate",
    "ValidationReport": "batchspec.run.validate",
    "job_status": "batchspec.run.status",
    "ShardState": "batchspec.io.states",
    # report
    "build_report": "batchspec.report.metrics",
    # choosing speculation
    "run_tune": "batchspec.tune.session",
    "TuneOptions": "batchspec.tune.model",
    "TuneReport": "batchspec.tune.model",
    "DistillOptions": "batchspec.distill.options",
    "DistillResult": "batchspec.distill.options",
    # errors
    "BatchspecError": "batchspec.errors",
    "SpecError": "batchspec.errors",
    "InputDataError": "batchspec.errors",
    "RuntimeFailure": "batchspec.errors",
    "Interrupted": "batchspec.errors",
}

__all__ = [
    "AutoSpeculation",
    "BatchspecError",
    "DistillOptions",
    "DistillResult",
    "ExecutionSpec",
    "ExecutorSpec",
    "InputDataError",
    "InputSpec",
    "Interrupted",
    "JobSpec",
    "LoraSpec",
    "ModelSpec",
    "OutputSpec",
    "RunOptions",
    "RunResult",
    "RuntimeFailure",
    "ShardState",
    "SpecError",
    "TuneOptions",
    "TuneReport",
    "ValidationReport",
    "__version__",
    "build_report",
    "build_spec",
    "distill",
    "job_status",
    "load_spec",
    "run_job",
    "run_tune",
    "validate_job",
]
assert set(__all__) == {*_HOMES, "distill", "__version__"}, "a public name without a home"


def __getattr__(name: str) -> Any:
    if name == "distill":
        # the package batchspec.distill, callable as batchspec.distill.session.distill (one
        # name for both: see batchspec/distill/__init__.py)
        return importlib.import_module("batchspec.distill")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'batchspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see
    from batchspec.distill.options import DistillOptions, DistillResult
    from batchspec.errors import (
        BatchspecError,
        InputDataError,
        Interrupted,
        RuntimeFailure,
        SpecError,
    )
    from batchspec.io.states import ShardState
    from batchspec.report.metrics import build_report
    from batchspec.run.job import RunOptions, RunResult, run_job
    from batchspec.run.status import job_status
    from batchspec.run.validate import ValidationReport, validate_job
    from batchspec.spec.build import build_spec
    from batchspec.spec.load import load_spec
    from batchspec.spec.model import (
        AutoSpeculation,
        ExecutionSpec,
        ExecutorSpec,
        InputSpec,
        JobSpec,
        LoraSpec,
        ModelSpec,
        OutputSpec,
    )
    from batchspec.tune.model import TuneOptions, TuneReport
    from batchspec.tune.session import run_tune
