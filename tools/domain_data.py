"""Write the distill benchmarks' domains, two the tiny models never saw (they were trained on
Python source), where the tiny target's continuations vary from prompt to prompt and the tiny
draft, distilled on Python, predicts them poorly:

- ``json``: JSON lines, the last one cut off near its end (about 0.37 greedy acceptance at k=4,
  against 0.63 on held-out Python);
- ``logs``: service log lines (timestamp, level, service, request id, method, path, status,
  latency, message), the last one cut off part-way (about 0.28).

Deterministic: the same seed writes the same rows, byte for byte, with no input but this file.
Usage: ``python tools/domain_data.py OUT_DIR [--domain json|logs] [--rows 2400] [--shards 4]
[--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

NAMES = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "oscar",
    "peggy",
    "rupert",
    "sybil",
    "trent",
    "victor",
    "walter",
]
CITIES = ["Paris", "Oslo", "Lima", "Quito", "Cairo", "Delhi", "Tokyo", "Perth", "Austin", "Porto"]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "red",
    "green",
    "blue",
    "north",
    "south",
    "fast",
    "slow",
    "open",
    "closed",
    "new",
    "old",
    "primary",
    "backup",
    "draft",
    "final",
    "error",
]
KEYS = [
    "id",
    "name",
    "user",
    "email",
    "city",
    "country",
    "age",
    "score",
    "price",
    "qty",
    "status",
    "tags",
    "items",
    "created",
    "updated",
    "enabled",
    "role",
    "level",
    "count",
    "total",
    "currency",
    "address",
    "zip",
    "phone",
    "notes",
    "owner",
    "team",
    "priority",
    "version",
    "path",
    "type",
    "value",
    "unit",
    "rating",
    "kind",
    "source",
    "target",
]


def _value(rng: random.Random, key: str, depth: int):
    """A value of a type that fits the key, sometimes nested."""
    if key in ("id", "age", "qty", "count", "level", "zip", "total"):
        return rng.randint(0, 9999)
    if key in ("price", "score", "rating", "value"):
        return round(rng.uniform(0, 500), rng.choice([1, 2]))
    if key in ("enabled",):
        return rng.choice([True, False])
    if key in ("name", "user", "owner"):
        return rng.choice(NAMES)
    if key == "email":
        return f"{rng.choice(NAMES)}@{rng.choice(WORDS)}.{rng.choice(['com', 'org', 'net'])}"
    if key == "city":
        return rng.choice(CITIES)
    if key in ("created", "updated"):
        return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if key == "tags":
        return rng.sample(WORDS, rng.randint(1, 4))
    if key == "path":
        return "/" + "/".join(rng.sample(WORDS, rng.randint(1, 3)))
    if key in ("items", "address") and depth < 2:
        if key == "items":
            return [_record(rng, depth + 1, rng.randint(2, 3)) for _ in range(rng.randint(1, 2))]
        return _record(rng, depth + 1, rng.randint(2, 3))
    if key == "phone":
        return f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    return rng.choice(WORDS)


def _record(rng: random.Random, depth: int, size: int) -> dict:
    keys = ["id"] + rng.sample(KEYS[1:], size - 1) if depth == 0 else rng.sample(KEYS, size)
    return {k: _value(rng, k, depth) for k in keys}


def prompt(rng: random.Random) -> str:
    """Two JSON lines, then a third cut off a few characters before its end."""
    lines = [json.dumps(_record(rng, 0, rng.randint(4, 8))) for _ in range(3)]
    return "\n".join(lines)[: -rng.randint(2, 12)]


SERVICES = ["api", "auth", "billing", "search", "worker", "gateway"]
LEVELS = ["INFO"] * 6 + ["WARN", "ERROR", "DEBUG"]
ROUTES = ["/v1/users", "/v1/orders", "/v1/items", "/health", "/v2/search", "/v1/invoices", "/login"]
METHODS = ["GET", "GET", "GET", "POST", "PUT", "DELETE"]
MESSAGES = [
    "request served",
    "cache miss",
    "retrying upstream",
    "token refreshed",
    "slow query",
    "connection reset",
]


def _log_line(rng: random.Random, t: int) -> str:
    """One service log line at ``t`` seconds into a day."""
    when = f"2026-11-{rng.randint(1, 28):02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z"
    route = rng.choice(ROUTES) + (f"/{rng.randint(1, 9999)}" if rng.random() < 0.6 else "")
    status = rng.choice([200, 200, 200, 201, 204, 400, 404, 500, 503])
    return (
        f"{when} {rng.choice(LEVELS):<5} {rng.choice(SERVICES)} req={rng.getrandbits(32):08x} "
        f"{rng.choice(METHODS)} {route} status={status} latency_ms={rng.randint(1, 2500)} "
        f'msg="{rng.choice(MESSAGES)}"'
    )


def log_prompt(rng: random.Random) -> str:
    """Two to four log lines, then one more cut off part-way."""
    t = rng.randint(0, 86400)
    lines = []
    for _ in range(rng.randint(3, 5)):
        t += rng.randint(0, 30)
        lines.append(_log_line(rng, t))
    return "\n".join(lines)[: -rng.randint(10, len(lines[-1]) * 2 // 3)]


DOMAINS = {"json": prompt, "logs": log_prompt}


def prompts(rows: int, seed: int = 0, domain: str = "json") -> list[str]:
    """``rows`` prompts of ``domain``, the same for the same seed."""
    rng = random.Random(seed)
    make = DOMAINS[domain]
    return [make(rng) for _ in range(rows)]


def write_shards(out_dir: Path, rows: int, shards: int, seed: int = 0, domain: str = "json") -> list[Path]:
    """Write ``rows`` prompts of ``domain`` (columns id, prompt) over ``shards`` Parquet files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = prompts(rows, seed, domain)
    per = -(-rows // shards)
    paths = []
    for i in range(shards):
        chunk = texts[i * per : (i + 1) * per]
        path = out_dir / f"part-{i:05d}.parquet"
        pq.write_table(
            pa.table({"id": [f"j{i * per + j:06d}" for j in range(len(chunk))], "prompt": chunk}), path
        )
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domain", choices=sorted(DOMAINS), default="json")
    args = parser.parse_args(argv)
    for path in write_shards(args.out_dir, args.rows, args.shards, args.seed, args.domain):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
