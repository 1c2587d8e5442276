"""The bookkeeping every model builder in tools/ shares: a build goes into a scratch folder beside
its output and is swapped in whole, with its card (``batchspec-model.json``) and the complete
marker, and a later build is skipped while the output is current.

Kept apart from the builders so that each builder's cache key (tools/model_cache.py keys a build
by the repository files it imports) names only what determines its weights."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

COMPLETE_MARKER = ".batchspec-complete"  # the same marker tools/tiny_models.py writes
INFO_FILE = "batchspec-model.json"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_current(out: Path, weights: Path, settings: dict, key: str = "source_sha256") -> bool:
    """True when ``out`` is complete and was built from the file ``weights`` as it is now (its
    SHA-256 under ``key`` in ``out``'s info file), with the same ``settings``."""
    if not (out / COMPLETE_MARKER).exists() or not (out / INFO_FILE).exists():
        return False
    try:
        info = json.loads((out / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get(key) == file_sha256(weights) and all(
        info.get(k) == value for k, value in settings.items()
    )


def scratch_dir(out: Path) -> Path:
    """An empty directory beside ``out`` to build it in (see :func:`publish`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path, info: dict) -> None:
    """Write ``info`` and the complete marker into ``tmp``, then swap it in as ``out``: a crash
    never leaves a half-built directory behind."""
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
