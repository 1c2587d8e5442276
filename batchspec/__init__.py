"""batchspec: offline batch LLM inference over Parquet shards with vLLM speculative decoding."""

__version__ = "0.1.0"
