"""examples/embeddings/ on the real engine (the session's shared embedding engine): its script
makes a table of documents, the job embeds them into a Lance dataset with a vector column, and
its query finds the nearest documents to a query embedded with the same model: code nearest code,
prose nearest prose."""

from __future__ import annotations

import subprocess
import sys
from importlib.machinery import SourceFileLoader

import pytest
from helpers.jobs import MODELS, ROOT

from batchspec.spec.load import load_spec

pytestmark = pytest.mark.engine

EXAMPLE = ROOT / "examples" / "embeddings"


def test_embeddings_example_finds_the_nearest_documents(tmp_path, shared_engines):
    docs, vectors = tmp_path / "docs", tmp_path / "vectors"
    subprocess.run([sys.executable, EXAMPLE / "make_documents.py", docs, "2"], check=True)
    env = {"DOCUMENTS": str(docs), "VECTORS": str(vectors)}
    spec = load_spec(EXAMPLE / "job.yaml", [f"model.target={MODELS / 'target'}"], environ=env)
    run = shared_engines.run(spec)
    assert run.exit_code == 0, run.log
    nearest = SourceFileLoader("nearest", str(EXAMPLE / "nearest.py")).load_module().nearest
    llm = shared_engines.engine(spec).llm
    for query, kind in (
        ("def load_settings(path):\n    with open(path) as f:", "code"),
        ("The old mill stands by the river in the town.", "prose"),
    ):
        (embedded,) = llm.embed([query], use_tqdm=False)
        top = nearest(str(vectors), embedded.outputs.embedding, k=3)
        assert top["kind"].to_list() == [kind] * 3, top
    again = shared_engines.run(spec)  # nothing left to do: every document is in the dataset once
    assert again.exit_code == 0 and again.summary["totals"]["rows"] == 0
