"""Shards on fsspec: listing and naming, reading, writing, the output directory and commits, retries."""
