"""Delta Lake and Iceberg tables for the tests: tables of prompts, a job over them, the rows an
output table holds, and ``batchspec run`` in a process (the fake engine in place of vLLM) that
SIGKILLs itself before or after a table commit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import yaml

#: Where a process run with :data:`TABLE_CRASH_CLI` kills itself: ``before`` (its shards' data
#: files written, the table commit not made) or ``after`` (the table commit made, batchspec's
#: manifests not written).
TABLE_CRASH_ENV = "BATCHSPEC_TEST_TABLE_CRASH"
#: Seconds the fake engine takes per request in such a process (0: none).
DELAY_ENV = "BATCHSPEC_TEST_DELAY_S"


def prompts(i: int, rows: int) -> pa.Table:
    return pa.table(
        {"prompt": [f"prompt {i}-{j}" for j in range(rows)], "k": pa.array(range(rows), pa.int64())}
    )


def delta_prompts(url: str, files: int = 3, rows: int = 5, storage_options=None, first: int = 0) -> None:
    """A Delta table of prompts, one data file per append (``prompt i-j``, ``k``)."""
    from deltalake import write_deltalake

    for i in range(first, first + files):
        write_deltalake(url, prompts(i, rows), mode="append", storage_options=storage_options)


def iceberg_catalog(tmp_path: Path, warehouse: str | None = None, **extra) -> dict:
    """A SQL catalog on SQLite (its properties), its warehouse on local disk unless given."""
    (tmp_path / "wh").mkdir(exist_ok=True)
    return {
        "type": "sql",
        "uri": f"sqlite:///{tmp_path}/catalog.db",
        "warehouse": warehouse or f"file://{tmp_path}/wh",
        **extra,
    }


def iceberg_prompts(catalog: dict, name: str = "ns.prompts", files: int = 3, rows: int = 5, first: int = 0):
    """An Iceberg table of prompts, one data file per append."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError

    cat = load_catalog("default", **catalog)
    try:
        cat.create_namespace(name.rsplit(".", 1)[0])
    except NamespaceAlreadyExistsError:
        pass
    try:
        table = cat.load_table(name)
    except NoSuchTableError:
        table = cat.create_table(name, schema=prompts(0, 1).schema)
    for i in range(first, first + files):
        table.append(prompts(i, rows))
    return table


def table_job(tmp_path: Path, fmt: str, out_fmt: str | None = None, **extra) -> dict:
    """A job over the table of prompts in ``tmp_path`` (``in`` for Delta, ``ns.prompts`` for
    Iceberg) into a table of the same format (or ``out_fmt``) at ``tmp_path/out``."""
    out_fmt = out_fmt or fmt
    catalog = iceberg_catalog(tmp_path)
    if fmt == "delta":
        inp = {"path": str(tmp_path / "in"), "format": "delta", "prompt_column": "prompt"}
    else:
        inp = {"format": "iceberg", "table": "ns.prompts", "catalog": catalog, "prompt_column": "prompt"}
    out = {"path": str(tmp_path / "out"), "format": out_fmt}
    if out_fmt == "iceberg":
        out.update(table="ns.results", catalog=catalog)
    raw = {
        "name": "tables",
        "input": inp,
        "output": out,
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "execution": {"max_in_flight": 4, "read_batch_rows": 3},
    }
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def make_input(tmp_path: Path, fmt: str, files: int = 3, rows: int = 5, first: int = 0) -> None:
    if fmt == "delta":
        delta_prompts(str(tmp_path / "in"), files, rows, first=first)
    else:
        iceberg_prompts(iceberg_catalog(tmp_path), files=files, rows=rows, first=first)


def table_rows(spec) -> list[str]:
    """The ``request_id`` of every row the output table holds, as a reader of it sees them."""
    out = spec.output
    if out.format == "delta":
        from deltalake import DeltaTable

        from batchspec.io.delta import object_store_options

        table = DeltaTable(out.path, storage_options=object_store_options(out.path, out.storage_options))
        return sorted(
            pa.table(table.to_pyarrow_dataset().to_table(columns=["request_id"]))["request_id"].to_pylist()
        )
    from batchspec.io.iceberg import load_catalog

    table = load_catalog(out.catalog, "output.catalog").load_table(out.table)
    return sorted(table.scan(selected_fields=("request_id",)).to_arrow()["request_id"].to_pylist())


def expected_ids(spec, files: int = 3, rows: int = 5) -> list[str]:
    """The request ids every input row gets (``<shard>/<row>``), from the input table's shards."""
    from batchspec.run.stages import plan

    return sorted(f"{s.name}/{j}" for s in plan(spec).shards for j in range(s.table.rows))


#: ``batchspec`` in a new process with the fake engine in place of vLLM, killing itself with
#: SIGKILL at :data:`TABLE_CRASH_ENV` (see there). argv: the tests folder, then the command line.
TABLE_CRASH_CLI = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import batchspec.engine.llm
import batchspec.engine.checks
from helpers.fakes import FakeEngine
delay = float(os.environ.get("BATCHSPEC_TEST_DELAY_S") or 0)
batchspec.engine.llm.Engine = lambda spec: FakeEngine(delay_s=delay)
batchspec.engine.checks.check_vllm_keys = lambda spec: None
batchspec.engine.checks.vllm_version = lambda: "none (fake engine)"
where = os.environ.get("BATCHSPEC_TEST_TABLE_CRASH")
if where:
    from batchspec.io.output_formats import TableOutput
    commit = TableOutput.commit_table
    def crashing(self, *args, **kw):
        if where == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = commit(self, *args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)
    TableOutput.commit_table = crashing
from batchspec.cli import main
sys.argv = ["batchspec", *sys.argv[2:]]
main()
"""


def table_cli(*args: str, crash: str | None = None, delay_s: float = 0.0, timeout: float = 120, env=None):
    """``batchspec ARGS`` in a process on the fake engine, killed ``crash`` (None: never)."""
    full = {**os.environ, **(env or {}), TABLE_CRASH_ENV: crash or "", DELAY_ENV: str(delay_s)}
    tests = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [sys.executable, "-c", TABLE_CRASH_CLI, str(tests), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        cwd=tests.parent,
    )


def run_table_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    process = table_cli(*args, **kw)
    stdout, stderr = process.communicate(timeout=kw.get("timeout", 120))
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def write_job(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def lance_prompts(url: str, files: int = 3, rows: int = 5, storage_options=None, first: int = 0) -> None:
    """A Lance dataset of prompts, one fragment per append (``prompt i-j``, ``k``)."""
    import lance

    for i in range(first, first + files):
        exists = bool(i) or first > 0
        lance.write_dataset(
            prompts(i, rows), url, mode="append" if exists else "create", storage_options=storage_options
        )


def lance_rows(spec) -> list[str]:
    """The ``request_id`` of every row the output Lance dataset holds, as a reader of it sees them."""
    import lance

    from batchspec.io.lance import dataset_uri, storage_options

    out = spec.output
    dataset = lance.dataset(
        dataset_uri(out.path, "output.path"), storage_options=storage_options(out.path, out.storage_options)
    )
    return sorted(dataset.to_table(columns=["request_id"])["request_id"].to_pylist())
