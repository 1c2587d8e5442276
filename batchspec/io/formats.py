"""Input file formats: which one a shard is, and the name its output takes.

``input.format`` says it for every shard of a job; without it each file's extension does, where
that is unambiguous: ``.jsonl`` and ``.ndjson`` are JSON lines, either compressed (``.gz``,
``.zst``); any other name is read as Parquet, as every file was before other formats existed (a
``.json`` file may be one JSON document rather than lines of them: JSON lines named so need
``input.format: jsonl``). An OpenAI Batch request file is JSON lines too, so ``openai`` is only
ever declared. A compressed name no JSON format claims (``.parquet.gz``, ``.json.gz`` without the
key) is a spec error naming ``input.format``."""

from __future__ import annotations

from batchspec.errors import SpecError
from batchspec.io.input_formats import INPUT_FORMATS
from batchspec.io.records import FileFormat
from batchspec.redact import sanitize_url

#: What ``input.format`` accepts.
FORMATS = tuple(INPUT_FORMATS)
#: The format a file no other format claims by its extension is read as.
PARQUET = "parquet"
#: The formats read as lines of JSON (compressed or not).
LINE_FORMATS = tuple(f.name for f in INPUT_FORMATS.values() if f.lines)

#: Extensions that name a format by themselves.
_FORMAT_SUFFIXES = {suffix: f.name for f in INPUT_FORMATS.values() for suffix in f.suffixes}
#: Extensions a shard may carry whatever its format says (``part-0.json`` with ``format: jsonl``).
_OTHER_SUFFIXES = (".json",)
#: Compression by extension, for JSON lines (Parquet compresses inside the file).
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def _split(name: str) -> tuple[str, str | None, str | None]:
    """``(stem, format suffix, compression)`` of a file name: ``a.jsonl.gz`` is
    ``("a", ".jsonl", "gzip")``."""
    stem, compression = name, None
    for suffix, codec in COMPRESSIONS.items():
        if stem.lower().endswith(suffix):
            stem, compression = stem[: -len(suffix)], codec
            break
    for suffix in (*_FORMAT_SUFFIXES, *_OTHER_SUFFIXES):
        if stem.lower().endswith(suffix):
            return stem[: -len(suffix)], suffix, compression
    return stem, None, compression


def file_format(path: str, declared: str | None, url: str | None = None) -> FileFormat:
    """The format of the input file at ``path`` (a path without a URL's query): ``declared``
    (``input.format``) if set, else its extension's, else Parquet. A SpecError naming
    ``input.format`` (and ``url``, the file as the job names it, without credentials) for a
    compressed file that would be read as Parquet."""
    _, suffix, compression = _split(path.rsplit("/", 1)[-1])
    path = url or path
    # a name no format claims is read as Parquet, as every file was before other formats existed
    name = declared or _FORMAT_SUFFIXES.get(suffix or "", PARQUET)
    if name == PARQUET and compression is not None:
        raise SpecError(
            "input.format",
            f"{sanitize_url(path)} is compressed as a whole ({compression}) and its "
            "name says no JSON-lines format: set input.format (jsonl or openai) if it "
            "holds JSON lines; Parquet files are read as they are",
        )
    return FileFormat(name, compression if name in LINE_FORMATS else None)


def output_stem(rel: str, file: FileFormat) -> str:
    """A shard's output stem: its relative path without its format's extensions. Parquet drops
    ``.parquet`` only (as before JSON lines existed: older outputs keep their names); JSON lines
    drop the compression's and the format's (``day=1/part-0.jsonl.gz`` -> ``day=1/part-0``)."""
    if file.name == PARQUET:
        return rel[: -len(".parquet")] if rel.endswith(".parquet") else rel
    head, _, name = rel.rpartition("/")
    stem, suffix, _ = _split(name)
    if suffix is None or suffix in (".parquet", ".pq"):
        return rel
    return f"{head}/{stem}" if head else stem


def is_input_file(path: str, declared: str | None) -> bool:
    """Whether a file found under an input *directory* is a shard: one whose extension names
    the declared format (any known format without one)."""
    _, suffix, compression = _split(path.rsplit("/", 1)[-1])
    named = _FORMAT_SUFFIXES.get(suffix or "")
    if declared in LINE_FORMATS and suffix in _OTHER_SUFFIXES:
        return True
    if named is None or (named == PARQUET and compression is not None):
        return False
    # a self-describing format of lines (OpenAI's) is found under the JSON-lines extensions
    return (
        declared is None
        or named == declared
        or (INPUT_FORMATS[declared].self_describing and INPUT_FORMATS[named].lines)
    )
