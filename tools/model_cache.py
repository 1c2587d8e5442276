"""Builds a tiny model once per content: `make models` runs each builder through this script.

    python tools/model_cache.py --models .models --outputs target draft --inputs $^ -- BUILD...

The key of a build is a SHA-256 of what determines it: each input file's bytes (a Python file's
with every file of this repository it imports, lazily or not, found by reading the imports; a
folder's, every file in it, for code reached through a registry of names), the
key of each model it is built from (an input inside the models folder whose folder carries a
key file), `requirements/cpu.lock`, the Python version and machine, the outputs' names and the
build command. Where the cache holds an entry of that key, its outputs are checked file by file
against the entry's manifest and copied into the models folder; else the command runs and its
outputs are stored. So a changed builder (or a changed model it starts from) rebuilds that model
and, through the keys, every model built from it.

The cache is ``$BATCHSPEC_MODEL_CACHE`` or, unset, ``${XDG_CACHE_HOME:-~/.cache}/batchspec/models``;
``BATCHSPEC_MODEL_CACHE=off`` builds without it. An entry is written beside its final name and
renamed into place with its manifest inside, so the cache never holds a half-written one; an
entry whose files do not match its manifest is removed and rebuilt, never used. Clearing the
cache is deleting that folder (docs/development.md).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_files import file_sha256  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Written into each output folder: the key it was built or restored under (a later model built
#: from it reads it for its own key).
KEY_FILE = ".batchspec-cache-key"
MANIFEST = "manifest.json"
CACHE_ENV = "BATCHSPEC_MODEL_CACHE"
#: Where this repository's Python is imported from by the builders (tools/ puts itself on the path).
IMPORT_ROOTS = (ROOT / "tools", ROOT)


def log(msg: str) -> None:
    print(f"[model-cache] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path | None:
    """The cache folder, or None where ``BATCHSPEC_MODEL_CACHE=off``."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchspec" / "models"


def _module_file(name: str) -> Path | None:
    """This repository's file for the module ``name``, or None for anything else."""
    parts = name.split(".")
    for root in IMPORT_ROOTS:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (inside functions too), with each parent package
    and each ``from X import Y`` as both ``X`` and ``X.Y`` (Y may be a submodule)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = None
    if path.is_relative_to(ROOT):
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    names: set[str] = set()
    for node in _runtime_nodes(tree, path.name == "__init__.py"):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package is not None:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    return {n for n in names | parents if n}


def _runtime_nodes(tree: ast.AST, package_init: bool):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (never run) and, in a
    package's ``__init__.py``, those in functions: there they are lazy re-exports (batchspec's
    ``__getattr__``), run when a name is asked of the package, which the builders never do."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            if package_init and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            todo.append(child)


def source_closure(entry: Path) -> list[Path]:
    """``entry`` and every file of this repository it imports, transitively, sorted."""
    seen: set[Path] = set()
    todo = [entry.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path):
            found = _module_file(name)
            if found is not None and found.resolve() not in seen:
                todo.append(found.resolve())
    return sorted(seen)


def build_key(models: Path, outputs: list[str], inputs: list[str], command: list[str]) -> str:
    """The key of a build: see the module's docstring."""
    models = models.resolve()
    parts: list[tuple[str, str]] = []
    for raw in sorted(set(inputs)):
        path = Path(raw).resolve()
        if path.is_relative_to(models) and (path.parent / KEY_FILE).is_file():
            parts.append((f"model:{path.parent.name}", (path.parent / KEY_FILE).read_text().strip()))
        elif path.suffix == ".py":
            for source in source_closure(path):
                parts.append((f"source:{_rel(source)}", file_sha256(source)))
        elif path.is_file():
            parts.append((f"file:{_rel(path)}", file_sha256(path)))
        elif path.is_dir():  # a whole package (code reached through a registry of names)
            for source in sorted(path.rglob("*")):
                if source.is_file() and "__pycache__" not in source.parts:
                    parts.append((f"file:{_rel(source)}", file_sha256(source)))
        else:
            raise SystemExit(f"model-cache: input {raw} is neither a file nor a folder")
    lock = ROOT / "requirements" / "cpu.lock"
    parts.append(("lock", file_sha256(lock) if lock.is_file() else "-"))
    parts.append(("python", f"{sys.version_info[:3]} {platform.machine()}"))
    parts.append(("outputs", " ".join(outputs)))
    parts.append(("command", json.dumps([_rel(Path(a)) if Path(a).is_absolute() else a for a in command])))
    digest = hashlib.sha256(json.dumps(sorted(set(parts))).encode()).hexdigest()
    return digest[:24]


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _manifest(folder: Path) -> dict[str, list]:
    """``{relative path: [size, sha256]}`` of every file under ``folder``."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        files[str(path.relative_to(folder))] = [path.stat().st_size, file_sha256(path)]
    return files


def _intact(entry: Path, outputs: list[str]) -> bool:
    """True when ``entry`` holds each output and every file matches its manifest, no more."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if sorted(manifest["outputs"]) != sorted(outputs):
            return False
        return _manifest(entry / "outputs") == files
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _restore(entry: Path, models: Path, outputs: list[str]) -> None:
    """Copy each output from ``entry`` into ``models``: copied beside, then renamed into place."""
    for name in outputs:
        dest = models / name
        tmp = models / f".{name}.restore-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(entry / "outputs" / name, tmp, symlinks=True)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)


def _store(cache: Path, entry: Path, models: Path, outputs: list[str], key: str) -> None:
    """Copy the built outputs into ``entry``: written aside with the manifest last, then renamed."""
    tmp = cache / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name in outputs:
            shutil.copytree(models / name, tmp / "outputs" / name, symlinks=True)
        manifest = {
            "key": key,
            "outputs": outputs,
            "stored": time.time(),
            "files": _manifest(tmp / "outputs"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            tmp.rename(entry)
        except OSError:  # another build stored the same key meanwhile: theirs stands
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(models: Path, outputs: list[str], inputs: list[str], command: list[str]) -> int:
    key = build_key(models, outputs, inputs, command)
    label = "+".join(outputs)
    cache = cache_dir()
    entry = cache / f"{label}-{key}" if cache is not None else None
    if entry is not None and entry.is_dir():
        started = time.monotonic()
        if _intact(entry, outputs):
            _restore(entry, models, outputs)
            log(f"{label}: restored from {entry} ({time.monotonic() - started:.1f} s)")
            return 0
        log(f"{label}: the cached entry {entry} is damaged (its files differ from its manifest): rebuilding")
        shutil.rmtree(entry, ignore_errors=True)
    started = time.monotonic()
    status = subprocess.call(command)
    if status != 0:
        return status
    missing = [name for name in outputs if not (models / name).is_dir()]
    if missing:
        log(f"{label}: the build did not make {', '.join(missing)}")
        return 1
    for name in outputs:
        (models / name / KEY_FILE).write_text(key + "\n")
    log(f"{label}: built in {time.monotonic() - started:.0f} s (key {key})")
    if entry is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _store(cache, entry, models, outputs, key)
            log(f"{label}: stored in {entry}")
        except OSError as exc:  # a cache that cannot be written costs speed, never the build
            log(f"{label}: not stored in the cache ({exc})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("model-cache: the build command follows --")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="the models folder")
    parser.add_argument("--outputs", nargs="+", required=True, help="the folders the build makes in it")
    parser.add_argument("--inputs", nargs="*", default=[], help="what the build reads (make's $^)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        raise SystemExit("model-cache: no build command after --")
    return run(args.models, args.outputs, args.inputs, command)


if __name__ == "__main__":
    sys.exit(main())
