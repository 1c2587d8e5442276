"""Where a run's shards are generated: base.py (the interface), local.py, ray.py."""
