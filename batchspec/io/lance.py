"""Lance datasets with pylance (the ``batchspec[lance]`` extra): a dataset as a job's input
(:class:`LanceInput`: its data fragments at a pinned version are the shards) and as its output
(:class:`LanceFragmentWriter`, :func:`table_state`, :func:`commit`: each shard's rows written as
fragments, then committed in idempotent group commits). See :mod:`batchspec.io.tables` for what
the table formats share.

Lance talks to object stores with its own client (object_store, as delta-rs does): the job's
fsspec ``storage_options`` are translated as for Delta (:func:`storage_options`).

A commit is made idempotent twice over. Each commit's transaction carries the shards it adds in
its properties (``batchspec.shards``), read back per version; and each shard's data files are
named after it (``data/<key>__<token>.lance``, :func:`file_key`: the shard's name escaped to the
characters object_store keeps as they are, or where that is long, its start and a hash of the
name), so the current manifest alone says which shards it holds, after the versions that
recorded them are cleaned up. A fragment written but not committed is named by no manifest:
invisible; the commit of its shard by a later run removes it (:func:`_remove_leftovers`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchspec.errors import InputDataError, RuntimeFailure, SpecError
from batchspec.io.reader import ParquetReader
from batchspec.io.records import CommitResult, FileFormat, Shard, ShardFile, TableFile, TableState
from batchspec.io.retry import retry
from batchspec.io.table_schema import check_output_schema
from batchspec.io.tables import (
    DATA_DIR,
    attempt_token,
    retry_commits,
    table_member,
)
from batchspec.io.urls import FAMILIES, open_url
from batchspec.io.writer import ParquetWriter
from batchspec.redact import sanitize_url

if TYPE_CHECKING:
    import pyarrow as pa

    from batchspec.io.output_dir import OutputDir
    from batchspec.spec.model import JobSpec

log = logging.getLogger(__name__)

LANCE_FILE = FileFormat("lance")
#: Transaction properties batchspec writes: the shards a commit adds (a JSON list), and each
#: one's lineage (a JSON object by shard; the Parquet outputs keep it in the file's footer).
SHARDS_PROPERTY = "batchspec.shards"
LINEAGE_PROPERTY = "batchspec.lineage"
#: Between a shard's escaped name and its attempt's token in a data file's name: the escaped
#: name never holds two underscores in a row (each ``_`` starts a ``_XX`` escape).
FILE_SEP = "__"
_KEPT = re.compile(r"[A-Za-z0-9.\-]")
#: The longest a data file name's shard part (:func:`file_key`) may be, in bytes: with the
#: separator, a token and the suffix, a name stays far below a file system's 255.
KEY_MAX = 160
#: Between the start of a long escaped name and the hash that stands for the whole of it: never
#: in an escaped name, whose every ``_`` starts a ``_XX`` escape of upper-case hex digits.
HASH_SEP = "_x"
_HASH_HEX = 32


# ------------------------------------------------------------------------------ shared


def storage_options(url: str, options: dict) -> dict[str, str]:
    """Lance's storage options for ``url`` from the job's fsspec ``storage_options``: delta-rs's
    translation (both are object_store clients), with Lance's names for the retry bounds."""
    from batchspec.io.delta import object_store_options

    out = object_store_options(url, options)
    out.pop("conditional_put", None)  # delta-rs's switch; Lance commits with a conditional put itself
    renamed = {"max_retries": "client_max_retries", "retry_timeout": "client_retry_timeout"}
    return {renamed.get(k, k): v for k, v in out.items()}


def dataset_uri(url: str, key: str) -> str:
    """The dataset's URL as Lance takes it: local paths absolute, a store's other spellings as
    its family's (``s3a`` as ``s3``, ``abfs`` as ``az``)."""
    if "://" not in url or url.startswith("file://"):
        return os.path.abspath(url.removeprefix("file://"))
    scheme, rest = url.split("://", 1)
    family = FAMILIES.get(scheme)
    if family not in ("s3", "gs", "az"):
        raise SpecError(key, f"Lance reads datasets on local disk, s3://, gs:// and az://, not {scheme}://")
    return f"{family}://{rest.rstrip('/')}"


def first_line(exc: BaseException) -> str:
    """Lance's message without the Rust source locations it appends."""
    lines = str(exc).strip().splitlines()
    return lines[0].split(", /")[0] if lines else type(exc).__name__


def _exists(fs, root: str) -> bool:
    """Whether a dataset is at ``root``: its versions' folder is there. Asked of fsspec, as
    Lance answers a missing dataset with the same ValueError as an unreadable one."""
    try:
        return fs.exists(f"{root}/_versions")
    except OSError as exc:
        raise RuntimeFailure(f"{sanitize_url(root)}: the store failed: {exc}") from exc


def _open(uri: str, options: dict[str, str], version: int | None = None):
    import lance

    return lance.dataset(uri, version=version, storage_options=options)


def canonical(schema: pa.Schema) -> pa.Schema:
    """A schema as the checks compare it: Lance names a fixed-size list's item ``item`` and
    makes it nullable, whatever the writer called it (an embedding's vector column)."""
    import pyarrow as pa

    def plain(t):
        if pa.types.is_fixed_size_list(t):
            return pa.list_(plain(t.value_type), t.list_size)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return pa.list_(plain(t.value_type))
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, plain(f.type)) for f in t])
        return t

    return pa.schema([pa.field(f.name, plain(f.type)) for f in schema])


def data_files(dataset, fragment, shown: str) -> list[str]:
    """A fragment's data files relative to the dataset's root (``data/...``); exit 3 naming the
    dataset and the file for one outside it. Lance resolves a file's path as one name below
    ``data/`` (it escapes ``/`` and ``..``), so only a file in another of the dataset's bases
    (``base_id``: another folder, another bucket) can be outside; it is refused as a Delta log's
    file outside the table is (:func:`batchspec.io.tables.table_member`)."""
    root = dataset.uri.rstrip("/")
    out = []
    for data in fragment.files:
        if data.base_id is None:
            where = f"{root}/{DATA_DIR}/{data.path}"
        else:
            base = dataset.base_paths().get(data.base_id)
            prefix = str(base.path).rstrip("/") if base is not None else f"<base {data.base_id}>"
            where = f"{prefix}/{DATA_DIR}/{data.path}" if base is not None and base.is_dataset_root else ""
            where = where or f"{prefix}/{data.path}"
        out.append(table_member(root, where, shown))
    return out


# ------------------------------------------------------------------------------- input


class LanceInput:
    """A Lance dataset as a job's input: each data fragment at a version is a shard."""

    format = "lance"

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.url = spec.input.paths[0].rstrip("/")
        self.shown = sanitize_url(self.url)
        self.identity = self.shown
        self.fs, self.root = open_url(self.url, spec.input.storage_options, "input.path")
        self.root = self.root.rstrip("/")
        self.uri = dataset_uri(self.url, "input.path")
        self.options = storage_options(self.url, spec.input.storage_options)
        self._dataset = None

    def _load(self, version: int | None):
        if not _exists(self.fs, self.root):
            raise InputDataError(self.shown, "no Lance dataset here (no _versions)")
        try:
            return _open(self.uri, self.options, version)
        except (ValueError, OSError) as exc:  # a version cleaned up, a manifest it cannot read
            what = f"version {version}" if version is not None else "the dataset"
            raise InputDataError(
                self.shown, f"cannot read {what} of this Lance dataset: {first_line(exc)}"
            ) from exc

    def latest(self) -> int | None:
        if self.spec.input.allow_empty and not _exists(self.fs, self.root):
            return None
        return self._load(None).version

    def shards(self, version: int | None) -> list[Shard]:
        """The fragments at ``version``, from its manifest alone (no data file is opened): each
        one's rows and data files fingerprint it. Its deletion file is not part of it, as an
        Iceberg data file's delete files are not: rows deleted after a fragment was answered
        stay answered, and a fragment not yet answered is read with the version's deletions."""

        if version is None:
            return []
        dataset = self._load(version)
        self._dataset = dataset
        shards = []
        for fragment in dataset.get_fragments():
            meta = fragment.metadata
            files = data_files(dataset, meta, self.shown)
            fingerprint = {
                "rows": int(meta.physical_rows),
                "files": files,
                "size": sum(int(d.file_size_bytes or 0) for d in meta.files),
            }
            shards.append(
                Shard(
                    url=f"{self.url}/{files[0]}" if files else f"{self.url}#{meta.id}",
                    path=f"{self.root}/{files[0]}" if files else self.root,
                    name=f"fragment-{meta.id:06d}",
                    fs=self.fs,
                    fingerprint=fingerprint,
                    format=LANCE_FILE,
                    table=TableFile(rows=int(meta.num_rows), source=self, task=meta.id),
                )
            )
        return sorted(shards, key=lambda s: s.name)

    def arrow_schema(self) -> pa.Schema:
        return self._dataset.schema

    def reader(self, shard: Shard, spec: JobSpec):
        return LanceFragmentReader(shard, spec, self)


class LanceFragmentReader(ParquetReader):
    """One fragment of a Lance dataset, read by Lance (its deletions applied) in record
    batches, ``input.filter`` applied to each by polars as for a Delta table (one engine both
    checks and applies it)."""

    def __init__(self, shard: Shard, spec: JobSpec, source: LanceInput):
        import polars as pl

        self._setup(shard, spec.input, spec.execution.read_batch_rows)
        self.source = source
        self.num_rows = shard.table.rows
        self._predicate = pl.sql_expr(spec.input.filter) if spec.input.filter else None
        self.kept_fields = self._check_schema(source.arrow_schema(), spec.output)

    def _batches(self):
        import polars as pl
        import pyarrow as pa

        fragment = self.source._dataset.get_fragment(self.shard.table.task)
        if fragment is None:
            raise InputDataError(self.shard.url, "its fragment is not in the dataset's version read")
        columns = list(self.columns)
        if self._predicate is not None:
            columns += [c for c in self._predicate.meta.root_names() if c not in columns]
        for batch in fragment.to_batches(columns=columns, batch_size=self.batch_rows):
            table = pa.Table.from_batches([batch])
            if self._predicate is not None:
                try:
                    table = pl.from_arrow(table).filter(self._predicate).to_arrow()
                except pl.exceptions.PolarsError as exc:
                    raise SpecError("input.filter", f"cannot filter {self.shard.url} with it: {exc}") from exc
            yield table

    def rows(self):
        import pyarrow as pa

        index = 0
        try:
            for table in self._batches():
                data = table.to_pydict()
                for i in range(table.num_rows):
                    yield self._row(index, {c: data[c][i] for c in data}, self.spec)
                    index += 1
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputDataError(
                self.shard.url, f"cannot read it (after row {index}): {first_line(exc)}"
            ) from exc

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ output


def _escape(name: str) -> str:
    """A shard's name as a data file's name: object_store percent-encodes ``/``, ``~``, ``%``
    and others in the one name Lance gives it, so every byte outside ``[A-Za-z0-9.-]`` is
    written ``_XX`` (reversible, and the same on every store)."""
    return "".join(ch if _KEPT.fullmatch(ch) else "".join(f"_{b:02X}" for b in ch.encode()) for ch in name)


def _unescape(escaped: str) -> str | None:
    try:
        raw = re.sub(rb"_([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), escaped.encode())
        return raw.decode()
    except UnicodeDecodeError:
        return None


def file_key(shard_name: str) -> str:
    """A shard's part of its data files' names: its name escaped (:func:`_escape`), or where
    that is over :data:`KEY_MAX` bytes (a long name, or one of many non-ASCII characters, each
    byte of which takes three), the escaped name's start, :data:`HASH_SEP` and a hash of the
    name. Only the escaped form gives the shard's name back (:func:`shard_of`); either form says
    whether a file is a shard's (:func:`key_of`)."""
    escaped = _escape(shard_name)
    if len(escaped) <= KEY_MAX:
        return escaped
    head = re.sub(r"_[0-9A-F]?$", "", escaped[: KEY_MAX - len(HASH_SEP) - _HASH_HEX])  # no half escape
    return f"{head}{HASH_SEP}{hashlib.sha256(shard_name.encode()).hexdigest()[:_HASH_HEX]}"


def data_file_name(shard_name: str, token: str) -> str:
    """A shard's data file, as a fragment names it (below the dataset's ``data/``)."""
    return f"{file_key(shard_name)}{FILE_SEP}{token}.lance"


def key_of(relative: str) -> str | None:
    """The :func:`file_key` a data file (relative to the dataset's root) was named with; None
    for a file batchspec did not name (a compaction's, another writer's, Lance's own)."""
    prefix = DATA_DIR + "/"
    if not relative.startswith(prefix) or not relative.endswith(".lance"):
        return None
    key, sep, _ = relative[len(prefix) : -len(".lance")].rpartition(FILE_SEP)
    head, hashed, digest = key.partition(HASH_SEP)
    if not sep or not key or (hashed and not re.fullmatch(f"[0-9a-f]{{{_HASH_HEX}}}", digest)):
        return None
    return None if "_" in re.sub(r"_[0-9A-F]{2}", "", head) else key


def shard_of(relative: str) -> str | None:
    """The shard a data file (relative to the dataset's root) was written for, where its name
    spells it; None for a file batchspec did not write, and for one named by a hash."""
    key = key_of(relative)
    return None if key is None or HASH_SEP in key else _unescape(key)


@dataclass
class LanceShardFile(ShardFile):
    """A shard's fragments, written and not yet committed (their metadata, for the commit)."""

    fragments: list = field(default_factory=list)
    #: The shard's lineage (spec, models, versions, run, the input's pin).
    lineage: dict = field(default_factory=dict)


class LanceFragmentWriter(ParquetWriter):
    """A shard's rows for a Lance output: streamed to a local temporary Parquet file as the
    Parquet output's are, then written as the dataset's fragments (Lance's own files, under
    ``data/``, named after the shard), which no reader sees until a commit names them. The
    dataset is created (empty, with the job's columns) by the first shard that needs it: a
    fragment's columns are the dataset's field ids."""

    def __init__(
        self, out, shard, kept, metadata, row_group_rows=1024, compression="zstd", result_fields=None
    ):
        super().__init__(out, shard, kept, metadata, row_group_rows, compression, result_fields)
        self.lineage = metadata

    def commit(self) -> dict[str, Any]:
        import pyarrow.parquet as pq

        self.flush()
        self._writer.close()
        out = self.out
        schema = self.schema.remove_metadata()
        dataset = _ensure_dataset(out, schema)
        target = dataset.schema
        check_output_schema(canonical(target), canonical(schema), "output.path", out.display_url)
        fragments = _write_fragments(out, dataset, pq.ParquetFile(self.tmp_path), target, self.row_group_rows)
        os.unlink(self.tmp_path)
        names = _name_after(out, self.shard.name, fragments)
        urls = [f"{out.display_url}/{DATA_DIR}/{n}" for n in names]
        size = sum(int(d.file_size_bytes or 0) for f in fragments for d in f.files)
        relative = f"{DATA_DIR}/{names[0]}" if names else DATA_DIR
        url = urls[0] if urls else out.display_url
        return {
            "output": sanitize_url(url),
            "output_info": {"size": size, "fragments": len(fragments)},
            "table_file": LanceShardFile(
                self.shard.name, relative, url, size, self.rows_written, fragments, self.lineage
            ),
        }


def _ensure_dataset(out: OutputDir, schema: pa.Schema):
    """The output dataset, created empty with ``schema`` where it is not there yet (another
    writer may create it first: then it is read)."""
    import lance

    uri, options = dataset_uri(out.url, "output.path"), storage_options(out.url, out.storage_options)
    if not _exists(out.fs, out.path):
        try:
            lance.write_dataset(schema.empty_table(), uri, mode="create", storage_options=options)
        except (ValueError, OSError) as exc:
            out.fs.invalidate_cache(out.path)
            if not _exists(out.fs, out.path):
                raise RuntimeFailure(
                    f"creating the Lance dataset {out.display_url} failed: {first_line(exc)}"
                ) from exc
        out.fs.invalidate_cache(out.path)
    return _open(uri, options)


def _write_fragments(out: OutputDir, dataset, parquet, target: pa.Schema, group_rows: int) -> list:
    """The rows of ``parquet`` as fragments of ``dataset`` (uncommitted), typed as the dataset
    has its columns (in its order)."""
    import pyarrow as pa
    from lance.fragment import write_fragments

    def batches():
        for batch in parquet.iter_batches(batch_size=max(group_rows, 1)):
            yield pa.Table.from_batches([batch]).select(target.names).cast(target).to_batches()[0]

    reader = pa.RecordBatchReader.from_batches(target, batches())
    try:
        return write_fragments(
            reader,
            dataset,
            schema=target,
            mode="append",
            max_rows_per_group=max(group_rows, 1),
            storage_options=storage_options(out.url, out.storage_options),
        )
    except (ValueError, OSError) as exc:
        raise RuntimeFailure(f"writing fragments to {out.display_url} failed: {first_line(exc)}") from exc


def _name_after(out: OutputDir, shard_name: str, fragments: list) -> list[str]:
    """Each fragment's data file moved to a name of the shard's own (Lance's writer chooses a
    random one), the fragment's metadata changed to it; the names, below ``data/``. A file
    moved and then not committed is named by no manifest."""
    from batchspec.io.output_dir import replace_durably

    token = attempt_token()
    names = []
    for i, fragment in enumerate(fragments):
        for j, data in enumerate(fragment.files):
            name = data_file_name(shard_name, f"{token}{'' if i == j == 0 else f'-{i}-{j}'}")
            src, dst = out.join(DATA_DIR, data.path), out.join(DATA_DIR, name)
            if out.is_local:  # on disk before a manifest names it, whatever the power does
                replace_durably(src, dst)
            else:
                retry(lambda s=src, d=dst: out.fs.mv(s, d), f"naming {sanitize_url(dst)}")
            data._path = name  # pylance's DataFile keeps its path in _path, with no setter
            names.append(name)
    return names


def _output(out: OutputDir):
    """The output dataset now, None where there is none."""
    out.fs.invalidate_cache(out.path)
    if not _exists(out.fs, out.path):
        return None
    uri, options = dataset_uri(out.url, "output.path"), storage_options(out.url, out.storage_options)
    try:
        return _open(uri, options)
    except (ValueError, OSError) as exc:
        raise RuntimeFailure(
            f"reading the Lance dataset {out.display_url} failed: {first_line(exc)}"
        ) from exc


#: Per dataset URI: the last version whose transaction was read, that transaction's uuid, and
#: what the transactions up to it record (shard -> lineage). A version's transaction never
#: changes once written; the uuid tells a dataset made again at the same location.
_RECORDED: dict[str, tuple[int, str | None, dict[str, dict]]] = {}


def _uuid(dataset, version: int) -> str | None:
    try:
        transaction = dataset.read_transaction(version)
    except (ValueError, OSError):  # the version was cleaned up
        return None
    return None if transaction is None else transaction.uuid


def recorded(dataset) -> dict[str, dict]:
    """The shards the dataset's transactions record (each one's lineage), from the versions
    still there; those this process read before are not read again."""
    seen, uuid, names = _RECORDED.get(dataset.uri, (0, None, {}))
    if seen and (dataset.version < seen or uuid is None or _uuid(dataset, seen) != uuid):
        seen, names = 0, {}
    names = dict(names)
    if dataset.version > seen:
        for transaction in dataset.get_transactions(dataset.version - seen):
            if transaction is not None:
                names.update(_shards_of(transaction.transaction_properties or {}))
    _RECORDED[dataset.uri] = (dataset.version, _uuid(dataset, dataset.version), names)
    return names


def _shards_of(properties: dict[str, str]) -> dict[str, dict]:
    """The shards a transaction's properties name, with their lineage; none where the property
    is not a JSON list of names (another writer set it): those shards are done again."""
    value = properties.get(SHARDS_PROPERTY)
    if not value:
        return {}
    try:
        names = json.loads(value)
        lineage = json.loads(properties.get(LINEAGE_PROPERTY) or "{}")
    except (ValueError, RecursionError):
        names, lineage = None, {}
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        log.warning("a Lance transaction's %s is not a JSON list of shard names: ignored", SHARDS_PROPERTY)
        return {}
    lineage = lineage if isinstance(lineage, dict) else {}
    return {n: lineage.get(n) if isinstance(lineage.get(n), dict) else {} for n in names}


def _current_files(dataset, out: OutputDir) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """The dataset's current fragments: batchspec's by shard (its first data file's URL), the
    others by the path of their first data file; and the :func:`file_key` of every batchspec
    data file among them. A file named by a hash is known by the shard whose key it has among
    those the transactions record; with their versions cleaned up, by its path."""
    files, others, keys, hashed = {}, {}, set(), {}
    for fragment in dataset.get_fragments():
        relative = data_files(dataset, fragment.metadata, out.display_url)
        if not relative:
            continue
        url = f"{out.display_url}/{relative[0]}"
        key = key_of(relative[0])
        name = shard_of(relative[0])
        if key is not None:
            keys.add(key)
        if name is not None:
            files.setdefault(name, url)
        elif key is not None and HASH_SEP in key:
            hashed.setdefault(key, (relative[0], url))
        else:
            others[relative[0]] = url
    if hashed:
        by_key = {file_key(name): name for name in recorded(dataset)}
        for key, (relative, url) in hashed.items():
            if key in by_key:
                files.setdefault(by_key[key], url)
            else:
                others[relative] = url
    return files, others, keys


def table_state(out: OutputDir) -> TableState:
    """The dataset at ``output.path`` now (not there yet: an empty state). A shard is committed
    where a current data file is named after it, or a transaction records it (read only for
    the shards no current file names: a compaction renames them)."""
    dataset = _output(out)
    if dataset is None:
        return TableState(exists=False)
    files, others, keys = _current_files(dataset, out)
    return TableState(
        exists=True,
        version=dataset.version,
        schema=dataset.schema,
        files=files,
        other_files=others,
        is_committed=lambda name: file_key(name) in keys or name in recorded(dataset),
    )


def check_schema(out: OutputDir, schema: pa.Schema) -> None:
    """Exit 2 naming the column where the dataset and this job's output differ."""
    dataset = _output(out)
    if dataset is not None:
        check_output_schema(canonical(dataset.schema), canonical(schema), "output.path", out.display_url)


def commit(
    out: OutputDir, files: list[ShardFile], schema: pa.Schema, metadata: dict[str, Any]
) -> CommitResult:
    """Append the shards' fragments in one commit whose transaction names the shards; those
    the dataset already holds are left out, and a commit that loses a race is tried again on
    the dataset as it then is.

    Lance rebases an Append over the appends committed since its read version without asking
    (they never conflict), so a shard another run committed in between would be appended
    twice. The fragments are committed as a Merge instead (the current fragments and the new
    ones, the schema unchanged): Lance refuses a Merge that any concurrent commit adding or
    changing fragments preceded, which makes this commit conditional on the version read, as
    an Iceberg commit is. Readers see the same rows as after an Append."""
    from lance import LanceDataset, LanceOperation
    from lance.commit import CommitConflictError
    from lance.dataset import Transaction

    uri, options = dataset_uri(out.url, "output.path"), storage_options(out.url, out.storage_options)

    def attempt() -> CommitResult | None:
        dataset = _output(out)
        if dataset is None:
            _ensure_dataset(out, schema)
            return None
        check_output_schema(canonical(dataset.schema), canonical(schema), "output.path", out.display_url)
        _, _, keys = _current_files(dataset, out)
        names = recorded(dataset)
        done = {f.shard for f in files if file_key(f.shard) in keys or f.shard in names}
        already = [f.shard for f in files if f.shard in done]
        todo = [f for f in files if f.shard not in done]
        if not todo:
            return CommitResult(dataset.version, [], already)
        existing = [fragment.metadata for fragment in dataset.get_fragments()]
        added = [fragment for f in todo for fragment in getattr(f, "fragments", [])]
        properties = {
            SHARDS_PROPERTY: json.dumps([f.shard for f in todo]),
            LINEAGE_PROPERTY: json.dumps(
                {f.shard: getattr(f, "lineage", {}) for f in todo}, sort_keys=True, default=str
            ),
            "batchspec.run-id": str(metadata.get("run_id")),
            "batchspec.spec-fingerprint": json.dumps(metadata.get("spec_fingerprint"), sort_keys=True),
        }
        operation = LanceOperation.Merge(existing + added, dataset.lance_schema)
        transaction = Transaction(dataset.version, operation, transaction_properties=properties)
        try:
            # Lance's own retries would rebase onto the new version without the check above
            done_ds = LanceDataset.commit(uri, transaction, storage_options=options, max_retries=0)
        except CommitConflictError:
            return None
        except (ValueError, OSError) as exc:
            raise RuntimeFailure(
                f"committing to the Lance dataset {out.display_url} failed: {first_line(exc)}"
            ) from exc
        try:
            _remove_leftovers(out, [f.shard for f in todo], done_ds)
        except Exception as exc:  # noqa: BLE001 (the shards are committed: a leftover is invisible)
            log.warning("could not remove leftover data files of %s: %s", out.display_url, exc)
        return CommitResult(done_ds.version, [f.shard for f in todo], already)

    return retry_commits(attempt, f"committing to the Lance dataset {out.display_url}")


def _remove_leftovers(out: OutputDir, shards: list[str], dataset) -> None:
    """Remove the data files of ``shards``, just committed in ``dataset``'s version, that this
    version does not name: those of attempts killed between writing their fragments and their
    commit (one per kill), which no manifest names. None of them can be committed any more, as
    every commit leaves out the shards the dataset holds: a run that took a shard over from a
    process still alive is safe from it. ``data/`` is listed once a run (at its first commit):
    the files there before it began."""
    state = out.table_state
    if state.listed is None:
        folder = out.join(DATA_DIR)
        out.fs.invalidate_cache(folder)
        try:
            found = retry(lambda: out.fs.ls(folder, detail=False), f"listing {sanitize_url(folder)}")
        except FileNotFoundError:
            found = []
        finally:  # a cached listing would hide the files later attempts write (s3fs's info)
            out.fs.invalidate_cache(folder)
        state.listed = [f"{DATA_DIR}/{path.rstrip('/').rsplit('/', 1)[-1]}" for path in found]
    keys = {file_key(name) for name in shards}
    leftovers = [relative for relative in state.listed if key_of(relative) in keys]
    if not leftovers:
        return
    # by file name: each holds its attempt's token, and a store may spell the folder otherwise
    named = {
        path.rstrip("/").rsplit("/", 1)[-1]
        for fragment in dataset.get_fragments()
        for path in data_files(dataset, fragment.metadata, out.display_url)
    }
    for relative in leftovers:
        if relative.rsplit("/", 1)[-1] not in named:
            log.info("removing %s: a data file of shard %s no commit named", relative, key_of(relative))
            out.remove(out.join(relative))
    state.listed = [relative for relative in state.listed if relative not in leftovers]


# ------------------------------------------------------------------------------ report


def fragment_rows(out: OutputDir, url: str) -> pa.Table:
    """The rows of the current fragment whose first data file is ``url``."""
    dataset = _output(out)
    if dataset is not None:
        for fragment in dataset.get_fragments():
            relative = data_files(dataset, fragment.metadata, out.display_url)
            if relative and f"{out.display_url}/{relative[0]}" == url:
                return fragment.to_table()
    raise InputDataError(sanitize_url(url), "no longer a fragment of the dataset")


def lineage(out: OutputDir, name: str) -> dict:
    """What the transaction that committed shard ``name`` records of it (empty where its
    version was cleaned up, or the fragment is not batchspec's)."""
    dataset = _output(out)
    return (recorded(dataset).get(name) or {}) if dataset is not None else {}
