"""Per-shard leases: one adapter per store over a shared compare-and-swap rule, the local lock,
ShardLeases."""
