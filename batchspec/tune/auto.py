"""``speculative: auto``: a run chooses its own speculation before the first shard.

``speculative: auto`` tries speculation off and the methods that need no draft model (n-gram
prompt lookup); ``speculative: {method: auto, drafts: [...], k: [...]}`` adds draft models and
EAGLE heads (each with the method its checkpoint's config calls for). The
run (batchspec/run/job.py) calls :func:`choose_speculation` once it knows its pending shards:

1. The choice's key: what decides which candidate is fastest, hashed (:func:`choice_key`): the
   target's and each draft's identity (their contents for local directories, as the output
   fingerprint identifies them), the LoRA adapters, every engine argument (throughput ones
   included: ``max_num_seqs`` changes the answer), the sampling and per-row sampling columns,
   the candidates (drafts, k, n-gram, concurrency levels, whether the batch knobs are measured
   and, where they are, ``execution.max_in_flight``), vLLM's version and the hardware
   (CPU model and count, GPU names). Not the input: tomorrow's rows are other rows of the same
   kind.
2. ``<output>/_batchspec/auto/<key>.json`` holds a choice made before under that key: the run
   uses it without measuring (``remeasure: true`` or ``batchspec run --remeasure`` measures
   again). A changed model, draft, sampling or machine is another key, so it is measured. A
   record of any other shape than the one written (edited, torn, another version, a field
   missing or of another type, a label that is not one of this job's candidates, a choice its
   recommendations do not give) is no record: a ``speculative_auto_record_ignored`` warning
   names it and what is wrong, and the run measures again. A reused choice is the section
   built from the job's own candidates, and it is reported (log, summary, shard metadata) by
   that section's label: what runs.
3. Otherwise ``batchspec tune``'s machinery (batchspec/tune/session.py) measures off and the
   candidates on a seeded sample of the run's pending rows, one engine at a time, within
   ``max_minutes``, with a progress event per engine; the recommendation per level becomes the
   section to run (:func:`batchspec.tune.predict.choose_section`: vLLM's per-batch-size k where
   one draft wins at every level). Unless ``batch_knobs: false``, tune's batch-knob stage
   (batchspec/tune/knobs.py) then measures ``max_num_seqs`` (with ``max_in_flight``) and
   ``max_num_batched_tokens`` for that choice, and the run sets those that beat the noise
   (:func:`resolved`). The record (choice, the chosen drafter's method and identity by content,
   measurements, the batch knobs measured and set, the sample's fingerprint, the predicted
   wall time of the pending rows) is written under the key, secrets scrubbed; a reused record
   sets the same knobs.

The output's fingerprint holds ``{"method": "auto"}``, never the choice: greedy rows are the
same text whatever runs (speculative decoding is lossless), and sampled rows are drawn from the
target's own distribution whatever runs (rejection sampling), though not the same draws as
another choice would make. Each shard's metadata names what ran (``speculative_method``, the
section in ``spec``, and ``speculative_auto``)."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

from batchspec.errors import SpecError
from batchspec.io.output_dir import OutputDir
from batchspec.redact import public_spec, scrub_text
from batchspec.spec.model import JobSpec
from batchspec.version import __version__

#: Bump when the key covers something new or the record's shape changes: older records are
#: then not reused.
RECORD_VERSION = 2  # 2: the batch knobs (``batch_knobs``: measured, chosen, run with)


@dataclass
class AutoChoice:
    """What ``speculative: auto`` runs with, and where that came from."""

    #: The speculative section to run; None: speculation off.
    speculative: dict[str, Any] | None
    #: How the choice reads: ``off``, ``draft k=3``, or the per-batch-size schedule.
    label: str
    #: Where the record is (``_batchspec/auto/<key>.json`` under the output).
    path: str
    key: str
    #: True when a stored record was used, without measuring.
    reused: bool
    #: The stored record (public: no secrets).
    record: dict[str, Any]
    #: The batch knobs run with (:meth:`batchspec.tune.knobs.KnobReport.settings`: the keys set
    #: under ``model.engine`` and ``execution``); empty: the job's own.
    knobs: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The run summary's ``speculative_auto`` section."""
        knobs = self.record.get("batch_knobs") or {}
        return {
            "chosen": self.label,
            "speculative": _public(self.speculative),
            "reused": self.reused,
            "record": self.path,
            "key": self.key,
            "measured_at": self.record.get("measured_at"),
            "predicted": self.record.get("predicted"),
            "batch_knobs": {
                "set": self.knobs,
                "chosen": knobs.get("chosen"),
                "baseline": knobs.get("baseline"),
                "gain": knobs.get("gain"),
                "noise": knobs.get("noise"),
                "decision": knobs.get("decision"),
            },
        }

    def knobs_text(self) -> str:
        """What the log says of the batch knobs: the stage's decision."""
        decision = (self.record.get("batch_knobs") or {}).get("decision")
        return f"; batch knobs: {decision}" if decision else ""


def check_auto(spec: JobSpec) -> None:
    """Refuse, before any work, what ``speculative: auto`` could only skip later: a draft given
    as a local path that does not exist (SpecError naming it, exit 2; vLLM would try it as a
    model hub id), and a head that does not fit the target (batchspec.engine.heads). The
    candidates' sections are batchspec's own, and a draft vLLM refuses or a
    sampling speculation cannot run is measured as skipped, with the reason, like tune does."""
    from batchspec.tune.search_space import missing_local_draft
    from batchspec.tune.session import check_candidate_models

    auto = spec.speculative_auto
    for i, draft in enumerate(auto.drafts if auto is not None else ()):
        reason = missing_local_draft({"model": draft})
        if reason:
            raise SpecError(f"speculative.drafts[{i}]", reason)
    check_candidate_models(spec, auto.drafts if auto is not None else (), "speculative.drafts")


def choose_speculation(
    spec: JobSpec, shards: list, pending_rows: int, out: OutputDir, events, remeasure: bool = False
) -> tuple[JobSpec, AutoChoice]:
    """The job with the chosen speculative section (``spec.speculative_auto`` kept), and the
    choice. Reuses the stored record under this job's key unless asked to measure."""
    auto = spec.speculative_auto
    assert auto is not None
    key, components = choice_key(spec)
    path = out.auto_choice_path(key)
    if not (remeasure or auto.remeasure):
        record = out.read_json(path)
        if record is None and out.exists(path):
            chosen, why = None, "it is not a JSON object (torn, null, or of another shape)"
        elif record is None:
            chosen, why = None, None
        else:
            chosen, why = _section_from_record(spec, record, key)
        if chosen is not None:
            speculative, label, knobs = chosen
            choice = AutoChoice(speculative, label, path, key, True, record, knobs)
            events.emit(
                "speculative_auto",
                f"speculative: auto: using {label}, measured "
                f"{record['measured_at']}{choice.knobs_text()}; `--remeasure` measures again",
                chosen=label,
                reused=True,
                record=path,
                batch_knobs=knobs,
            )
            return resolved(spec, speculative, knobs), choice
        if why is not None:
            events.emit(
                "speculative_auto_record_ignored",
                f"speculative: auto: not using the stored choice {path}: {why}; measuring again",
                level="warning",
                record=path,
                reason=why,
            )
    record, speculative, label, knobs = _measure(spec, shards, pending_rows, events, key, components)
    if record["recommended"]:
        out.write_json(path, record)
    else:  # nothing measured in time: run with off now, measure again next time
        path = "(not kept: nothing was measured within max_minutes)"
    predicted = record.get("predicted") or {}
    choice = AutoChoice(speculative, label, path, key, False, record, knobs)
    events.emit(
        "speculative_auto",
        f"speculative: auto: chose {label}"
        + (
            f"; predicted generation time of the {pending_rows} pending rows {predicted['wall_s']:.0f}s"
            if predicted.get("wall_s")
            else ""
        )
        + choice.knobs_text(),
        chosen=label,
        reused=False,
        record=path,
        batch_knobs=knobs,
    )
    return resolved(spec, speculative, knobs), choice


def resolved(spec: JobSpec, speculative: dict | None, knobs: dict | None = None) -> JobSpec:
    """The job as it runs: ``speculative`` set to the choice and the batch knobs chosen
    (``knobs``: keys under ``model.engine`` and ``execution``), in ``raw`` too, so the shards'
    metadata show what ran; ``speculative_auto`` kept."""
    raw = copy.deepcopy(spec.raw)
    raw["speculative"] = copy.deepcopy(speculative)
    model, execution = spec.model, spec.execution
    engine = dict((knobs or {}).get("model.engine") or {})
    if engine:
        model = dataclasses.replace(model, engine={**model.engine, **engine})
        raw_model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        raw["model"] = {**raw_model, "engine": {**(raw_model.get("engine") or {}), **engine}}
    feed = dict((knobs or {}).get("execution") or {})
    if feed:
        execution = dataclasses.replace(execution, **feed)
        raw["execution"] = {**(raw.get("execution") or {}), **feed}
    return dataclasses.replace(
        spec, speculative=copy.deepcopy(speculative), raw=raw, model=model, execution=execution
    )


# --------------------------------------------------------------------------- the key


def choice_key(spec: JobSpec) -> tuple[str, dict[str, str]]:
    """(the key, its components' digests): see the module docstring, point 1."""
    from batchspec.engine.checks import vllm_version
    from batchspec.spec.fingerprint import DigestCache, model_identity, spec_fingerprint
    from batchspec.tune.session import default_concurrency

    auto = spec.speculative_auto
    assert auto is not None
    fingerprint = spec_fingerprint(spec)
    cache = DigestCache()
    drafts = [model_identity(d, cache=cache) for d in auto.drafts]
    cache.save()
    engine = public_spec({"model": {"engine": dict(spec.model.engine)}})["model"]["engine"]
    parts = {
        "model.target": fingerprint["model.target"],
        "model.lora": fingerprint.get("model.lora"),
        "model.engine": engine,
        "sampling": fingerprint["sampling"],
        "columns": fingerprint["columns"],
        "candidates": {
            "drafts": drafts,
            "k": list(auto.k),
            "ngram": auto.ngram,
            "concurrency": list(auto.concurrency or [default_concurrency(spec)]),
            "sample": auto.sample,
            "seed": auto.seed,
            "batch_knobs": auto.batch_knobs,
            # what the knobs are measured around (model.engine's are in the engine's digest)
            "max_in_flight": spec.execution.max_in_flight if auto.batch_knobs else None,
        },
        "vllm": vllm_version(),
        "hardware": hardware(),
    }
    digests = {name: _digest(value) for name, value in parts.items()}
    return _digest(digests), digests


def hardware() -> dict[str, Any]:
    """What the measurements depend on about this machine: architecture, CPU model, the cores
    this process may use, and the GPUs it sees (none on a CPU build)."""
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch or no driver: no GPU to name
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- measuring


class _EventStream:
    """tune's progress lines (one per engine) as ``speculative_auto_progress`` events."""

    def __init__(self, events):
        self.events, self.buffer = events, ""

    def write(self, text: str) -> int:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            line = line.removeprefix("batchspec tune: ").strip()
            if line:
                self.events.emit("speculative_auto_progress", f"speculative: auto: {line}")
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _measure(
    spec: JobSpec, shards: list, pending_rows: int, events, key: str, components: dict[str, str]
) -> tuple[dict, dict | None, str, dict]:
    """Measure with tune's machinery on the pending shards; (record, section, label, the batch
    knobs to set)."""
    from batchspec.tune.model import TuneOptions
    from batchspec.tune.session import default_concurrency, run_tune, tune_secrets

    auto = spec.speculative_auto
    assert auto is not None
    levels = list(auto.concurrency or [default_concurrency(spec)])
    options = TuneOptions(
        sample=auto.sample,
        seed=auto.seed,
        concurrency=levels,
        drafts=list(auto.drafts),
        ks=list(auto.k),
        repeats=2,
        top=1,
        max_minutes=auto.max_minutes,
        ngram=auto.ngram,
        batch_knobs=auto.batch_knobs,
    )
    events.emit(
        "speculative_auto_measuring",
        "speculative: auto: measuring speculation off, "
        + ("n-gram, " if auto.ngram else "")
        + (f"{len(auto.drafts)} draft(s) at k {','.join(map(str, auto.k))} " if auto.drafts else "")
        + f"on a sample of {auto.sample} pending rows at concurrency "
        f"{','.join(map(str, levels))}"
        + (", then the batch knobs for the choice" if auto.batch_knobs else "")
        + f" (at most {auto.max_minutes:g} min)",
        drafts=len(auto.drafts),
        levels=levels,
    )
    started = time.monotonic()
    base = dataclasses.replace(spec, speculative_auto=None, speculative=None)
    report = run_tune(base, options, job=spec.name, stream=_EventStream(events), shards=shards)
    speculative, label, level = _section(spec, report.recommended)
    wall = report.predicted_wall_s(level, pending_rows) if level is not None else None
    if wall is None and report.recommended:
        top = max(report.recommended)
        wall = report.predicted_wall_s(top, pending_rows)
    measured = report.as_dict()
    sample_digest = _digest(sorted(report.sample_ids))
    record = {
        "version": RECORD_VERSION,
        "key": key,
        "key_components": components,
        "chosen": label,
        "speculative": _public(speculative),
        "drafter": _drafter(speculative),
        "recommended": {str(c): v for c, v in report.recommended.items()},
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "measuring_s": round(time.monotonic() - started, 1),
        "sample": {
            "rows": report.sample_rows,
            "seed": auto.seed,
            "rows_in_pending_shards": report.rows_seen,
            "shards": [s.name for s in shards],
            "fingerprint": sample_digest,
        },
        "predicted": {
            "rows": pending_rows,
            "wall_s": None if wall is None else round(wall, 1),
            "concurrency": level,
            # each level measured: what was recommended there, at what rate, and how
            # long the pending rows would take at that many in flight
            "per_level": {
                str(c): _level_prediction(report, c, pending_rows) for c in sorted(report.recommended)
            },
        },
        "measurements": {k: measured[k] for k in ("candidates", "noise", "prediction", "lossless", "notes")},
        # measured for the choice above, and the settings it runs with (empty: the job's own)
        "batch_knobs": {**measured["batch_knobs"], "set": report.batch_knobs.settings()},
        "batchspec_version": __version__,
    }
    if report.mismatches:  # lossless broken: never run a candidate that changed greedy text
        speculative, label = None, "off (a candidate's greedy text differed from off's)"
        record.update(chosen=label, speculative=None)
        record["batch_knobs"].update(
            set={}, decision="the job's batch values are kept: they were measured for another choice"
        )
    secrets = tune_secrets(spec, auto.drafts)
    record = json.loads(scrub_text(json.dumps(record, default=str), secrets))
    return record, speculative, label, record["batch_knobs"]["set"]


def _level_prediction(report, c: int, rows: int) -> dict[str, Any]:
    label = report.recommended[c]
    tps = report.rate(label, c)
    wall = report.predicted_wall_s(c, rows)
    return {
        "recommended": label,
        "tokens_per_s": None if tps is None else round(tps, 2),
        "wall_s": None if wall is None else round(wall, 1),
    }


def _candidates(spec: JobSpec) -> dict[str, Any]:
    """This job's candidates (``tune.model.Candidate``) by label."""
    from batchspec.tune.search_space import candidates

    auto = spec.speculative_auto
    assert auto is not None
    fixed, families = candidates(
        dataclasses.replace(spec, speculative=None), list(auto.drafts), list(auto.k), auto.ngram
    )
    return {c.label: c for c in fixed + [c for f in families.values() for c in f]}


def _section(spec: JobSpec, recommended: dict[int, str]) -> tuple[dict | None, str, int | None]:
    """(the section to run, its label, the level it was chosen at; None for a per-batch-size
    schedule) from the recommendation per level, with this job's candidates."""
    from batchspec.tune.predict import choose_section

    if not recommended:
        return None, "off (nothing was measured in time)", None
    by_label = _candidates(spec)

    def section(c: int) -> tuple[dict | None, int | None]:
        cand = by_label.get(recommended[c])
        if cand is None or cand.speculative is None:
            return None, None
        return copy.deepcopy(cand.speculative), cand.k

    max_num_seqs = spec.model.engine.get("max_num_seqs")
    speculative, level = choose_section(
        recommended, section, max_num_seqs if isinstance(max_num_seqs, int) else None
    )
    if level is None:
        label = "; ".join(f"c={c}: {v}" for c, v in sorted(recommended.items()))
        return speculative, f"per batch size ({label})", None
    return speculative, recommended[level], level


def _section_from_record(
    spec: JobSpec, record: Any, key: str
) -> tuple[tuple[dict | None, str, dict] | None, str | None]:
    """(the stored choice as a section of this job, its label and the batch knobs to set, None)
    where the record has
    the shape :func:`_measure` writes and names only this job's candidates; else (None, what is
    wrong with it). The section is built from the job's own candidates, so a draft's path is
    the job's, never the record's public view, and the label is what that section runs."""
    if not isinstance(record, dict):
        return None, f"it holds a JSON {type(record).__name__}, not a JSON object"
    if record.get("version") != RECORD_VERSION:
        return None, f"its version is {_json_text(record.get('version'))}, not {RECORD_VERSION}"
    if record.get("key") != key:
        return None, f"its key is {_json_text(record.get('key'))}, not the {key} it is filed under"
    for field, types in (
        ("chosen", str),
        ("measured_at", str),
        ("predicted", dict),
        ("speculative", (dict, type(None))),
    ):
        if field not in record:
            return None, f"its {field} is missing"
        if not isinstance(record[field], types):
            return None, f"its {field} is {_json_text(record[field])}"
    chosen = record["chosen"]
    recommended = record.get("recommended")
    if not isinstance(recommended, dict) or not recommended:
        return None, f"its recommended is {_json_text(recommended)}, not a label per level"
    labels = _candidates(spec)
    levels: dict[int, str] = {}
    for c, label in recommended.items():
        if not (c.isdecimal() and int(c) > 0):
            return None, f"its recommended has the level {_json_text(c)}, not a number of requests"
        if not isinstance(label, str) or label not in labels:
            return None, (
                f"its recommended names {_json_text(label)}, not a candidate of "
                f"this job ({', '.join(labels)})"
            )
        levels[int(c)] = label
    knobs, why = _knobs_from_record(record.get("batch_knobs"))
    if why is not None:
        return None, why
    if record["speculative"] is None and (chosen == "off" or chosen.startswith("off (")):
        return (None, chosen, knobs), None  # off, measured so, or no candidate kept greedy text
    speculative, label, _ = _section(spec, levels)
    if label != chosen:
        return None, (f"its chosen is {_json_text(chosen)}, but its recommended gives {_json_text(label)}")
    return (speculative, label, knobs), None


#: The batch knobs a record may set: section -> its keys.
_KNOB_KEYS = {"model.engine": ("max_num_seqs", "max_num_batched_tokens"), "execution": ("max_in_flight",)}


def _knobs_from_record(value: Any) -> tuple[dict, str | None]:
    """(the batch knobs a record's ``batch_knobs.set`` says to run with, None), or ({}, what is
    wrong with it): a mapping of ``model.engine`` and ``execution`` to positive integers under
    the knobs' own names, and nothing else."""
    if not isinstance(value, dict) or not isinstance(value.get("set"), dict):
        shown = value.get("set") if isinstance(value, dict) else value
        return {}, f"its batch_knobs.set is {_json_text(shown)}, not the settings run with"
    for section, values in value["set"].items():
        keys = _KNOB_KEYS.get(section)
        if keys is None or not isinstance(values, dict):
            return {}, f"its batch_knobs.set has {_json_text(section)}, not model.engine or execution"
        for k, v in values.items():
            if k not in keys or isinstance(v, bool) or not isinstance(v, int) or v < 1:
                return {}, f"its batch_knobs.set.{section} has {k}: {_json_text(v)}, not a knob's size"
    return copy.deepcopy(value["set"]), None


def _drafter(speculative: dict | None) -> dict | None:
    """What the chosen drafter is: its method (from its checkpoint's config) and, for a draft
    model or a head, its identity by content (the digests the output's fingerprint uses), so a
    record read later says which weights were measured; None for off and n-gram."""
    from batchspec.spec.fingerprint import model_identity

    model = (speculative or {}).get("model")
    if not model:
        return None
    identity = model_identity(str(model))
    local = identity.get("local") or {}
    return {"method": speculative.get("method"), "weights": local.get("weights"), "digest": _digest(identity)}


def _json_text(value: Any) -> str:
    """A record's value as a message quotes it: its JSON, cut short."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _public(speculative: dict | None) -> dict | None:
    return None if speculative is None else public_spec({"speculative": speculative})["speculative"]
