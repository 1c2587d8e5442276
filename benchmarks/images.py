"""An image job against bare ``LLM.chat`` on the same image rows, whole process.

N rows of held-out pictures of the tiny vision-language model (tools/tiny_vlm.py: PNG bytes in a
Parquet ``binary`` column, a question in another) in Parquet shards. Both sides are timed as a
scheduler runs them, start-up included: ``batchspec run`` with ``input.image_columns`` (every row
generated: ``dedupe_window: 0``), and a script that reads the same shards with pyarrow, decodes
every picture with Pillow and calls ``LLM.chat`` once over all N conversations (vLLM's best case:
one call, no writing, every image decoded up front). Each is sampled for its peak RSS (the
process, and its tree) every 50 ms (``benchmarks/pooling.py``'s ``timed``). Rows per second is N
over the wall time; batchspec's should be at least 0.97x bare's.

Usage: ``python benchmarks/images.py [--rows 4000] [--shards 4] [--repeats 1] [--json FILE]``
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from common import print_report  # noqa: E402
from pooling import timed  # noqa: E402
from tiny_vlm import HELD_OUT_SEED, QUESTIONS, picture  # noqa: E402

ENGINE = {
    "max_model_len": 256,
    "enforce_eager": True,
    "dtype": "float32",
    "limit_mm_per_prompt": {"image": 1},
}
SAMPLING = {"temperature": 0.0, "max_tokens": 6}

BARE = """
import io, os, sys
import pyarrow.parquet as pq

def main():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as batchspec's engine has it
    from PIL import Image
    from vllm import LLM, SamplingParams
    conversations = []
    for path in sys.argv[2:]:
        table = pq.read_table(path, columns=["question", "img"])
        for question, data in zip(table["question"].to_pylist(), table["img"].to_pylist()):
            image = Image.open(io.BytesIO(data)).convert("RGB")
            parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
            conversations.append([{"role": "user", "content": parts}])
    llm = LLM(model=sys.argv[1], seed=0, **%(engine)r)
    outputs = llm.chat(conversations, SamplingParams(**%(sampling)r), use_tqdm=False)
    assert len(outputs) == len(conversations)

if __name__ == "__main__":
    main()
"""


def image_shards(folder: Path, rows: int, shards: int, seed: int) -> list[Path]:
    """``rows`` held-out pictures and questions in ``shards`` Parquet files."""
    rng = random.Random(seed)
    kinds = sorted(QUESTIONS)
    paths = []
    per = rows // shards
    for s in range(shards):
        questions, images = [], []
        for i in range(per):
            image, _ = picture(rng)
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            images.append(buf.getvalue())
            questions.append(rng.choice(QUESTIONS[kinds[i % len(kinds)]]))
        path = folder / f"part-{s:05d}.parquet"
        table = pa.table({"question": questions, "img": pa.array(images, pa.binary())})
        pq.write_table(table, path)
        paths.append(path)
    return paths


def image_job(work: Path, name: str, target: str) -> Path:
    job = work / f"job-{name}.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "images-bench",
                "input": {
                    "path": str(work / "in" / "*.parquet"),
                    "prompt_column": "question",
                    "image_columns": ["img"],
                },
                "output": {"path": str(work / f"out-{name}")},
                "model": {"target": target, "engine": ENGINE},
                "sampling": SAMPLING,
                "execution": {"dedupe_window": 0},
            }
        )
    )
    return job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target = str(ROOT / ".models" / "vlm")
    rows = args.rows // args.shards * args.shards
    results: dict = {"rows": rows, "shards": args.shards, "bare": [], "batchspec": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "in").mkdir()
        paths = image_shards(work / "in", rows, args.shards, HELD_OUT_SEED + 7)
        (work / "bare.py").write_text(BARE % {"engine": ENGINE, "sampling": SAMPLING})
        exe = str(Path(sys.executable).with_name("batchspec"))
        for r in range(args.repeats):
            job = image_job(work, str(r), target)
            results["bare"].append(timed([sys.executable, str(work / "bare.py"), target, *map(str, paths)]))
            results["batchspec"].append(timed([exe, "run", str(job), "--no-progress"]))
    for side in ("bare", "batchspec"):
        best = min(r["wall_s"] for r in results[side])
        results[f"{side}_rows_per_s"] = round(rows / best, 1)
    results["ratio"] = round(results["batchspec_rows_per_s"] / results["bare_rows_per_s"], 3)
    print_report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
