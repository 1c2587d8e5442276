"""Write a small table of documents to embed: Parquet files of code snippets and prose, each row
a ``doc_id``, a ``kind`` and a ``text``.

Usage: ``python examples/embeddings/make_documents.py OUT_DIR [FILES]``."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CODE = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)",
    "def write_config(path, config):\n    with open(path, 'w') as f:\n        json.dump(config, f)",
    "for i in range(10):\n    total += i * i",
    "class Stack:\n    def __init__(self):\n        self.items = []",
    "import os\nfor name in os.listdir('.'):\n    print(name)",
]
PROSE = [
    "The river runs past an old mill where children play in summer.",
    "A quiet town keeps its market open on sundays.",
    "The baker sells bread to travellers who stop on their way north.",
    "People talk about the weather and the harvest.",
    "The long road home runs under a grey sky.",
]


def main(out: str, files: int = 2) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    docs = [("code", t) for t in CODE] + [("prose", t) for t in PROSE]
    per = -(-len(docs) // files)
    for f in range(files):
        part = docs[f * per : (f + 1) * per]
        table = pa.table(
            {
                "doc_id": [f"doc-{f * per + i:03d}" for i in range(len(part))],
                "kind": [k for k, _ in part],
                "text": [t for _, t in part],
            }
        )
        pq.write_table(table, root / f"part-{f}.parquet")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
