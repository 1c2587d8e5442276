"""`tune --write`: the job spec as its author wrote it (variables kept, never their values), the
recommendation written into it, and the checks on every file tune writes."""

from __future__ import annotations

import copy
import fnmatch
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from batchspec.errors import RuntimeFailure, SpecError
from batchspec.redact import (
    literal_secrets,
    sanitize_url,
    scrub_text,
    url_literal_secrets,
)
from batchspec.spec.load import apply_override, load_yaml, unshared
from batchspec.spec.model import JobSpec
from batchspec.tune.model import TuneReport
from batchspec.tune.predict import choose_section

# --------------------------------------------------------------------------- --write


class _Quoted(str):
    """A quoted scalar holding ``${VAR}``: written quoted again, so it stays a string when the
    written job is loaded (a plain ``${N}`` is typed by what it expands to)."""


class _AsWrittenLoader(yaml.SafeLoader):
    """SafeLoader that leaves ``${VAR}`` unexpanded and remembers which ones were quoted."""


def _construct_str(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    value = loader.construct_scalar(node)
    return _Quoted(value) if node.style and "${" in value else value


class _WrittenDumper(yaml.SafeDumper):
    """SafeDumper that writes :class:`_Quoted` single-quoted."""


def _as_written(text: str, source: str, key_path: str = "") -> Any:
    # the spec loader first, with nothing in its environment: its alias and size limits, its
    # errors; then the same text with every ${VAR} left as written
    load_yaml(text, source, {}, key_path)
    return unshared(yaml.load(text, Loader=_AsWrittenLoader))  # noqa: S506 (a SafeLoader)


def spec_as_written(job_path: str, overrides: tuple[str, ...] | list[str] = ()) -> dict:
    """The job file's mapping as the user wrote it, ``${VAR}`` not expanded (in the file and in
    the ``--set`` values alike), with the ``--set`` overrides applied."""
    raw = _as_written(Path(job_path).read_text(), str(job_path)) or {}
    if not isinstance(raw, dict):
        raise SpecError(None, f"{job_path}: the job spec must be a mapping of keys")
    for item in overrides:
        apply_override(copy.deepcopy(raw), item, {})  # its checks: KEY=VALUE, a mapping on the way
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _as_written(value, f"--set {key.strip()}", key.strip()) if value.strip() else ""
    return raw


def check_writable(raw: dict, drafts: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse (exit 2) a ``--write`` whose file would hold a literal credential: the job as
    written (``raw``, from :func:`spec_as_written`), or a ``--draft`` URL that could become its
    ``speculative.model``. Each place is named, with the ``${VAR}`` form to use instead."""
    found = literal_secrets(raw)
    found += [f"--draft {sanitize_url(d)!r} ({what})" for d in drafts for what in url_literal_secrets(str(d))]
    if not found:
        return
    # (no example URL with a query here: the message goes through the URL sanitiser)
    raise SpecError(
        "--write",
        "refused: the written job would hold a literal credential: "
        + "; ".join(found)
        + ". tune never writes one: give it as an environment "
        "variable, written as ${VAR} (in the job file, e.g. hf_token: ${HF_TOKEN}; "
        "single-quoted on the command line, e.g. --set "
        "'model.engine.hf_token=${HF_TOKEN}'; a draft URL that holds a credential "
        "as the job's own draft, e.g. --set 'speculative.model=${DRAFT_URL}'). "
        "Nothing was measured",
    )


def written_spec(
    job_path: str, overrides: tuple[str, ...], report: TuneReport, max_num_seqs: int | None
) -> str:
    """The job file with the recommended ``speculative`` section, as ``--write`` writes it.

    The job's own YAML as written (``${VAR}`` never expanded, in the file and in ``--set``
    values) with the ``--set`` overrides applied; the section is the job's own as written when
    the recommendation is the job's draft at another k. A comment at the top says which
    concurrency the choice is for. Raises SpecError rather than write a literal credential."""
    raw = spec_as_written(job_path, overrides)
    measured = [c for c in report.concurrency if c in report.recommended]
    if not measured:
        raise RuntimeFailure("--write: nothing was recommended (speculation off was not measured)")
    job_section = raw.get("speculative")

    def section(c: int) -> tuple[dict | None, int | None]:
        e = report.entry(report.recommended[c], c)
        cand = e.candidate if e else None
        if cand is None or cand.speculative is None:
            return None, None
        if cand.from_job and isinstance(job_section, dict):
            return {**copy.deepcopy(job_section), "num_speculative_tokens": cand.k}, cand.k
        return copy.deepcopy(cand.speculative), cand.k

    recs = "; ".join(f"{k}: {v}" for k, v in sorted(report.recommended.items()))
    chosen, c = choose_section({c: report.recommended[c] for c in measured}, section, max_num_seqs)
    if c is None:
        raw["speculative"] = chosen
        header = [
            "# Written by batchspec tune from " + Path(job_path).name + ": one speculative "
            "section for every concurrency measured,",
            f"# recommended per concurrency ({recs}), as vLLM's per-batch-size k "
            "(num_speculative_tokens_per_batch_size; k 0 = speculation off there).",
        ]
    else:
        raw["speculative"] = chosen
        why = (
            "the only concurrency measured"
            if len(measured) == 1
            else f"the measured level nearest the job's max_num_seqs ({max_num_seqs})"
            if max_num_seqs is not None
            else "the largest level measured; the job sets no max_num_seqs"
        )
        header = [
            f"# Written by batchspec tune from {Path(job_path).name}: speculative = {report.recommended[c]},",
            f"# recommended for concurrency {c} ({why}).",
        ]
        if len(measured) > 1:
            header.append(f"# Recommended per concurrency: {recs}.")
    header += write_knobs(raw, report.batch_knobs)
    check_writable(raw)
    header.append(
        f"# Objective {report.options.objective}; sample of {report.sample_rows} rows, "
        f"seed {report.options.seed}."
    )
    if overrides:  # their keys: the values are in the body, written once
        keys = ", ".join(dict.fromkeys(item.partition("=")[0].strip() for item in overrides))
        header.append(f"# --set applied: {keys}")
    header = [scrub_text(line) for line in header]
    return "\n".join(header) + "\n" + yaml.dump(raw, Dumper=_WrittenDumper, sort_keys=False)


def write_knobs(raw: dict, knobs) -> list[str]:
    """The batch knobs chosen (``model.engine.max_num_seqs``, ``max_num_batched_tokens``,
    ``execution.max_in_flight``) written into ``raw``, the job as written; the header's line
    saying what was chosen or kept, and why. Nothing where the stage did not run."""
    if knobs is None:
        return []
    for section, values in knobs.settings().items():
        parts = section.split(".")
        node = raw
        for part in parts:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node.update(values)
    return [f"# Batch knobs: {knobs.decision}."]


# --------------------------------------------------------------------------- output files


def check_output_files(job: str, spec: JobSpec, files: dict[str, str | None]) -> None:
    """Exit 2 naming the option, before anything is measured, for an output file tune could
    not write or should not: ``files`` maps an option (``--html``, ``--write``) to its path.

    Refused: a directory, anything but a regular file, a directory that does not exist or
    cannot be written to, an existing file that cannot be written, two options naming one file,
    the job file itself, a file inside the job's (local) output path, one an input pattern
    matches or inside an input directory."""
    seen: dict[str, str] = {}
    job_real = os.path.realpath(job)
    for option, value in files.items():
        if not value:
            continue
        path = Path(value)
        real = os.path.realpath(value)
        if value.endswith(("/", os.sep)) or path.is_dir():
            raise SpecError(option, f"{value!r} is a directory; name a file")
        parent = path.parent
        if not parent.is_dir():
            raise SpecError(option, f"{value!r}: the directory {str(parent)!r} does not exist")
        if path.exists() and not path.is_file():
            raise SpecError(option, f"{value!r} exists and is not a regular file")
        if path.exists() and not os.access(path, os.W_OK):
            raise SpecError(option, f"{value!r} exists and is not writable")
        try:
            fd, probe = tempfile.mkstemp(prefix=".batchspec-tune-", dir=parent)
        except OSError as exc:
            raise SpecError(
                option, f"{value!r}: cannot write in {str(parent)!r}: {exc.strerror or exc}"
            ) from None
        os.close(fd)
        os.unlink(probe)
        if real == job_real:
            raise SpecError(
                option,
                f"{value!r} is the job file itself; write to another file "
                "(and move it over the job if that is what you want)",
            )
        if real in seen:
            raise SpecError(option, f"{value!r} is also the file of {seen[real]}")
        seen[real] = option
        where = _job_location(real, spec)
        if where:
            raise SpecError(option, f"{value!r} {where}; write it elsewhere")


def _local(url: str) -> str | None:
    """The local path of a job location, None for a remote store."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url or "::" in url else url


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _job_location(real: str, spec: JobSpec) -> str | None:
    """How ``real`` (a resolved local path) is one of the job's own locations, or None."""
    out = _local(spec.output.path)
    if out is not None and _inside(real, os.path.realpath(out)):
        return f"lies in the job's output path {spec.output.path!r}"
    for url in spec.input.paths:
        path = _local(url)
        if path is None:
            continue
        parts = path.split("/")
        wild = next((i for i, part in enumerate(parts) if any(ch in part for ch in "*?[")), None)
        if wild is not None:
            base = os.path.realpath("/".join(parts[:wild]) or ("/" if path.startswith("/") else "."))
            pattern = os.path.join(base, *parts[wild:])
            if fnmatch.fnmatchcase(real, pattern):
                return f"matches the job's input pattern {url!r}"
        elif _inside(real, os.path.realpath(path)):
            return (
                f"is the job's input {url!r}"
                if real == os.path.realpath(path)
                else f"lies in the job's input directory {url!r}"
            )
    return None


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (a thread of vLLM's
    creating a file meanwhile would otherwise get it wide open)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def write_output(path: str, text: str, like: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a private temporary file beside it,
    fsynced, renamed over it), readable by no one the job file ``like`` is not readable by:
    mode 0666 less the umask, and never wider than ``like``'s."""
    umask = _umask()
    try:
        like_mode = os.stat(like).st_mode & 0o666
    except OSError:
        like_mode = 0o600
    mode = 0o666 & ~umask & like_mode
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_AsWrittenLoader.add_constructor("tag:yaml.org,2002:str", _construct_str)


_WrittenDumper.add_representer(
    _Quoted, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="'")
)
