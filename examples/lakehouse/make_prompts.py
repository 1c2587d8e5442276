"""Write a small Delta table of prompts (``id``, ``prompt``, ``lang``), one data file per
append, to try examples/lakehouse/job.yaml on: ``python make_prompts.py TABLE [APPENDS]``."""

from __future__ import annotations

import sys

import pyarrow as pa
from deltalake import write_deltalake

TOPICS = ["tides", "lighthouses", "bread", "comets", "owls", "maps"]


def append(table: str, batch: int) -> None:
    rows = [(f"b{batch}-{i}", topic) for i, topic in enumerate(TOPICS)]
    write_deltalake(
        table,
        pa.table(
            {
                "id": [r[0] for r in rows],
                "prompt": [f"Write one sentence about {topic}." for _, topic in rows],
                "lang": ["en" if i % 3 else "fr" for i in range(len(rows))],
            }
        ),
        mode="append",
    )


if __name__ == "__main__":
    table, appends = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for batch in range(appends):
        append(table, batch)
