"""Write sample prompt shards: code snippets from standard-library files the tiny models never
saw, with widely varying output lengths, for the demo, the tests and the benchmarks.

Usage: ``python tools/demo_data.py OUT_DIR [--shards 4] [--rows 48]``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import held_out_snippets  # noqa: E402


def prompt_table(
    rows: int,
    seed: int,
    first_id: int = 0,
    max_tokens: tuple[int, int] = (8, 96),
    adapters: tuple[str, ...] = (),
) -> pa.Table:
    """``rows`` prompts with ids, a source tag and a per-row ``max_tokens`` in a wide range;
    with ``adapters``, an ``adapter`` column naming one of them or null (the base model) per
    row, in turn."""
    rng = random.Random(seed)
    snippets = held_out_snippets(rows, seed=seed)
    table = pa.table(
        {
            "id": [f"p{first_id + i:06d}" for i in range(rows)],
            "prompt": snippets,
            "topic": [rng.choice(["io", "text", "net", "math", "os"]) for _ in range(rows)],
            "max_tokens": pa.array([rng.randint(*max_tokens) for _ in range(rows)], pa.int32()),
        }
    )
    if adapters:
        turn = [None, *adapters]
        table = table.append_column(
            "adapter", pa.array([turn[(first_id + i) % len(turn)] for i in range(rows)], pa.string())
        )
    return table


def document_questions_table(
    documents: int, questions: int, seed: int, doc_chars: int = 1200, max_tokens: int = 24
) -> pa.Table:
    """Several questions about each of ``documents`` documents (code files the tiny models never
    saw): every prompt is the document, then one question, so the ``questions`` rows of a
    document share a long prefix (about 300 tokens of the tiny tokenizer). Rows are in a seeded
    random order, as a dataset joined from two tables often is: a document's rows are scattered."""
    rng = random.Random(seed)
    snippets = held_out_snippets(documents * 8, seed=seed)
    docs = []
    for d in range(documents):
        text = ""
        for snippet in snippets[d * 8 : (d + 1) * 8]:
            text += snippet + "\n"
            if len(text) >= doc_chars:
                break
        docs.append(text[:doc_chars])
    asks = [
        "What does this code do?",
        "Which functions are defined here?",
        "What does the first function return?",
        "Which modules are imported?",
        "Is there any error handling?",
        "What would you rename?",
        "Summarise it in a line.",
        "What are the inputs?",
    ]
    rows = [(d, q) for d in range(documents) for q in range(questions)]
    rng.shuffle(rows)
    return pa.table(
        {
            "id": [f"d{d:04d}-q{q:02d}" for d, q in rows],
            "document": [f"d{d:04d}" for d, _ in rows],
            "prompt": [f"{docs[d]}\n# Question: {asks[q % len(asks)]} ({q})\n# Answer:" for d, q in rows],
            "max_tokens": pa.array([max_tokens] * len(rows), pa.int32()),
        }
    )


def write_shards(
    out_dir: Path, shards: int, rows: int, seed: int = 0, adapters: tuple[str, ...] = ()
) -> list[Path]:
    """Write ``shards`` Parquet files of ``rows`` prompts each; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = out_dir / f"part-{i:05d}.parquet"
        pq.write_table(
            prompt_table(rows, seed + i, first_id=i * rows, adapters=adapters), path, row_group_size=64
        )
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--adapters",
        default="",
        help="comma-separated LoRA adapter names: adds an `adapter` column naming "
        "one of them, or null (the base model), per row in turn",
    )
    args = parser.parse_args(argv)
    adapters = tuple(a for a in args.adapters.split(",") if a)
    for path in write_shards(args.out_dir, args.shards, args.rows, args.seed, adapters):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
