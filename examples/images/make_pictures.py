"""Sample rows for examples/images/job.yaml: pictures of the tiny vision-language model's kind
(tools/tiny_vlm.py) saved as PNG files, and a Parquet shard of rows naming them, each with a
question and the answer it should get (`truth`); the last row's photo is corrupt (its row gets
an error; the rest run).

Usage: ``python examples/images/make_pictures.py [OUT_DIR]`` (default
``out/examples/pictures``): writes ``OUT_DIR/rows/part-00000.parquet`` and
``OUT_DIR/photos/*.png``."""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from tiny_vlm import QUESTIONS, picture  # noqa: E402


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def main(out: Path, rows: int = 8, seed: int = 11) -> Path:
    rng = random.Random(seed)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "photos").mkdir(parents=True, exist_ok=True)
    kinds = sorted(QUESTIONS)
    table = {"id": [], "question": [], "photo_path": [], "truth": []}
    for i in range(rows):
        image, truth = picture(rng)
        photo = out / "photos" / f"photo-{i}.png"
        photo.write_bytes(png(image) if i != rows - 1 else png(image)[:100])
        kind = kinds[i % len(kinds)]
        table["id"].append(f"row-{i}")
        table["question"].append(QUESTIONS[kind][0])
        table["photo_path"].append(str(photo.resolve()))
        table["truth"].append(truth[kind])
    path = out / "rows" / "part-00000.parquet"
    pq.write_table(pa.table(table), path)
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/examples/pictures")))
