"""The model card written beside a distilled draft: the job as written (its public view), the
training and the acceptance before and after."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from batchspec.distill.options import DistillOptions
from batchspec.redact import public_spec, sanitize_url
from batchspec.spec.methods import reads_hidden_states
from batchspec.spec.model import JobSpec
from batchspec.version import __version__

# --------------------------------------------------------------------------- the card


def _set_as_written(raw: dict, item: str) -> None:
    """Apply one ``--set KEY=VALUE`` without expanding ``${VAR}`` (the value as YAML)."""
    import yaml

    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        return
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return
        node = child
    node[parts[-1]] = parsed


def public_job(spec: JobSpec, job_path: str | None, overrides: tuple[str, ...] = ()) -> dict:
    """The job as written (``${VAR}`` kept, ``--set`` applied as given) in its public view
    (:func:`batchspec.redact.public_spec`: no secret, no URL userinfo or query). Without the
    file (a library call), the public view of the resolved spec."""
    import yaml

    raw = None
    if job_path:
        try:
            raw = yaml.safe_load(Path(job_path).read_text())
        except (OSError, yaml.YAMLError):
            raw = None
    if not isinstance(raw, dict):
        return public_spec(spec.raw)
    for item in overrides:
        _set_as_written(raw, item)
    return public_spec(raw)


def public_path(value: str | None) -> str | None:
    return None if value is None else sanitize_url(str(value))


def build_card(
    spec: JobSpec,
    opts: DistillOptions,
    *,
    sample,
    gen,
    trained,
    layers: int,
    parameters: int,
    before: dict | None,
    after: dict | None,
    data_fingerprint: str,
    started: float,
    data: dict | None = None,
    decision: dict | None = None,
) -> dict:
    """``batchspec-model.json``: what the draft is and how it was made, in the public view of the
    job (``${VAR}`` as written, no secret, URLs without userinfo or query)."""
    job = public_job(spec, opts.job_path, opts.overrides)
    model = job.get("model") if isinstance(job.get("model"), dict) else {}
    return {
        # what the drafter is beside the target (batchspec.spec.methods): a head or a draft
        "role": "head" if reads_hidden_states(opts.method) else "draft",
        "method": opts.method,
        "parent_draft": public_path(opts.start) if opts.init == "draft" else None,
        "init": opts.init,
        "layers": layers,
        "parameters": parameters,
        "target": model.get("target"),
        # the adapters whose outputs the draft learned (rows per input.lora_column), if any
        "lora": model.get("lora"),
        "job": {"name": job.get("name", spec.name), "path": public_path(opts.job_path), "spec": job},
        "sample_size": len(sample.train),
        "validation_size": len(getattr(sample, "validation", ())),
        "heldout_size": len(sample.heldout),
        "population": sample.population,
        "steps": opts.steps,
        # how much data the rule asked for, what was generated, the steps it supports
        "data": data,
        "lr": opts.lr,
        "batch_size": opts.batch_size,
        "seed": opts.seed,
        "logprobs": opts.logprobs,
        "sampling": job.get("sampling") or {},
        "data_fingerprint": data_fingerprint,
        "generation": {
            "generated_rows": gen.generated_rows,
            "reused_rows": gen.reused_rows,
            "failed_rows": gen.failed_rows,
            "wall_s": round(gen.wall_s, 2),
        },
        "training": {
            "steps_run": trained.steps,
            "loss": trained.loss,
            "top1_agreement": trained.top1_agreement,
            "best_step": trained.best_step,
            "validation_agreement": trained.validation_agreement,
            "start_validation_agreement": trained.start_validation_agreement,
            "stopped_early": trained.stopped_early,
            "stopped_by_time": getattr(trained, "stopped_by_time", False),
            "validation_metric": trained.metric,
            "wall_s": round(trained.wall_s, 2),
            "device": trained.device,
        },
        "acceptance": {"before": before, "after": after},
        "decision": decision,
        "wall_s": round(time.monotonic() - started, 2),
        "batchspec_version": __version__,
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }
