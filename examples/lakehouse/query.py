"""What a downstream reader of the results table sees, with polars: ``python query.py RESULTS
PROMPTS``. Only committed shards are in the table (batchspec commits each group of shards in one
table commit), so this query never sees half a shard, whenever it runs."""

from __future__ import annotations

import sys

import polars as pl

results, prompts = sys.argv[1], sys.argv[2]
answers = pl.read_delta(results).select("request_id", "generated_text", "finish_reason", "num_output_tokens")
joined = pl.read_delta(prompts).join(answers, left_on="id", right_on="request_id", how="left")
summary = joined.group_by("lang").agg(
    prompts=pl.len(),
    answered=pl.col("generated_text").is_not_null().sum(),
    output_tokens=pl.col("num_output_tokens").sum(),
)
print(summary.sort("lang"))
print(joined.filter(pl.col("generated_text").is_not_null()).select("id", "prompt", "generated_text").head(3))
