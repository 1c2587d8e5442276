"""A parallel draft against a sequential one, on the large tier, at 1 to 64 requests in flight.

Both start from the tiny 1-layer draft (``.models/draft``) and are distilled on the same prompts
(JSON records cut off mid-way, tools/domain_data.py, which the tiny draft never saw) with the
same options: ``batchspec distill --method draft_model`` and ``--method pard``. They are trained
on the tiny target's text, which is ``target-large``'s (the same function, grown:
tools/grow_model.py), and measured with ``target-large`` by ``batchspec tune`` on prompts neither
saw, greedy, at each concurrency: speculation off, the sequential draft, the parallel draft
drafting in parallel (``pard:NAME``) and the same weights drafting a token a pass (``NAME``),
each at k 3. Printed: each one's output tok/s against off, its mean acceptance length and
acceptance per position, and up to which concurrency each pays (tok/s above off's by more than
tune's noise).

Usage: ``python benchmarks/parallel_drafts.py [--models .models] [--work bench-results/pard]
[--json bench-results/pard.json]``. Drafts built by an earlier run in ``--work`` are reused
(``--fresh`` builds them again)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import print_report  # noqa: E402
from heads import batchspec, large_tier_arguments, large_tier_jobs, markdown, tune_drafts  # noqa: E402


def pays_up_to(rows: list[dict], candidate: str, noise: dict) -> int | None:
    """The highest concurrency up to which ``candidate`` is faster than off at every level by
    more than tune's noise threshold there (a share of off's tok/s); None where it is not at the
    first."""
    off = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["candidate"] == "off"}
    best = None
    for r in sorted((r for r in rows if r["candidate"] == candidate), key=lambda r: r["concurrency"]):
        c, tps = r["concurrency"], r["output_tokens_per_s"]
        threshold = float((noise.get(str(c)) or noise.get(c) or {}).get("threshold") or 0.0)
        if tps is None or not off.get(c) or tps <= off[c] * (1 + threshold):
            break
        best = c
    return best


def main() -> int:
    args = large_tier_arguments(__doc__, "pard", train_rows=400, concurrency="1,4,16,64", sample=64)
    models, work, train, hidden = large_tier_jobs(args, seeds=(21, 22))
    report: dict = {"domain": "JSON records (tools/domain_data.py)", "max_tokens": args.max_tokens}
    common = [
        "--draft",
        str(models / "draft"),
        "--sample",
        str(args.train_rows),
        "--holdout",
        "60",
        "--steps",
        str(args.steps),
        "--k",
        args.k.split(",")[0],
        "--force",  # both installed: the comparison is tune's, below
        "--json",
    ]
    drafts = {"sequential": work / "draft-seq", "parallel": work / "draft-pard"}
    for name, method in (("sequential", "draft_model"), ("parallel", "pard")):
        if not (drafts[name] / "batchspec-model.json").exists():
            report[f"distill_{name}"] = batchspec(
                "distill", str(train), "--method", method, "--out", str(drafts[name]), *common
            )
    labels = {
        "off": "off",
        "draft-seq": "sequential draft",
        "pard:draft-pard": "parallel draft",
        "draft-pard": "parallel draft's weights, a token a pass",
    }
    report["tune"] = tune_drafts(hidden, args, [drafts["sequential"], drafts["parallel"]], labels)
    rows, noise = report["tune"]["rows"], report["tune"]["noise"] or {}
    report["pays_up_to"] = {name: pays_up_to(rows, name, noise) for name in set(labels.values()) - {"off"}}
    report["load_average"] = os.getloadavg()
    print_report(report, args.json)
    print(markdown(rows))
    print("pays up to (requests in flight):", report["pays_up_to"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
