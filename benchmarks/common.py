"""What several benchmark scripts share: the tiny pair as their jobs run it, and how a report is
printed and kept (``--json FILE``)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The engine arguments the throughput-style benchmarks run the tiny target with.
TINY_ENGINE = {"max_model_len": 512, "enforce_eager": True, "dtype": "float32", "max_num_seqs": 128}
#: The tiny draft at k = 4.
TINY_DRAFT = {"method": "draft_model", "model": str(ROOT / ".models" / "draft"), "num_speculative_tokens": 4}


def snippet_shards(root: Path, rows: int, shards: int, column: str, seed: int) -> list[Path]:
    """``rows`` held-out code snippets (tools/tiny_models.py) in ``shards`` Parquet files under
    ``root``, columns ``id`` and ``column``; their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tiny_models import held_out_snippets

    snippets = held_out_snippets(rows, seed=seed)
    per = -(-rows // shards)
    paths = []
    for s in range(shards):
        part = snippets[s * per : (s + 1) * per]
        path = root / f"part-{s:03d}.parquet"
        pq.write_table(pa.table({"id": [f"r{s}-{i}" for i in range(len(part))], column: part}), path)
        paths.append(path)
    return paths


def print_report(report: dict, json_path: Path | None) -> None:
    """Print the report as JSON, and write it to ``json_path`` too where given."""
    print(json.dumps(report, indent=2))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
