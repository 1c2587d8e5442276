"""The documents nearest a query, as a search service would find them: the query embedded with
the same model (vLLM's ``LLM.embed``), then the cosine against every row of the vector column,
in polars. A dataset too large for that gets an index instead (``lance`` ``create_index``).

Usage: ``python examples/embeddings/nearest.py VECTORS QUERY [K]``."""

from __future__ import annotations

import sys


def nearest(vectors: str, query_vector: list[float], k: int = 3):
    import lance
    import numpy as np
    import polars as pl

    frame = pl.from_arrow(lance.dataset(vectors).to_table(columns=["request_id", "kind", "embedding"]))
    matrix = frame["embedding"].to_numpy()  # Array(Float32, 256): one row a document
    q = np.asarray(query_vector, dtype=np.float32)
    cosine = matrix @ q / (np.linalg.norm(matrix, axis=1) * np.linalg.norm(q))
    return (
        frame.select("request_id", "kind").with_columns(cosine=cosine).sort("cosine", descending=True).head(k)
    )


def main() -> None:
    vectors, query = sys.argv[1], sys.argv[2]
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    from vllm import LLM

    llm = LLM(model=".models/target", runner="pooling", convert="embed", max_model_len=512, dtype="float32")
    (out,) = llm.embed([query], use_tqdm=False)
    print(nearest(vectors, out.outputs.embedding, k))


if __name__ == "__main__":
    main()
