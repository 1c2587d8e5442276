"""Counts vLLM engine start-ups, for sizing the test suite: with BATCHSPEC_TEST_ENGINE_LOG set,
every ``vllm.LLM(...)`` built in a process that has this folder on its path appends one JSON line
to that file, naming the test that was running (pytest's PYTEST_CURRENT_TEST, which the test's
subprocesses inherit), the model, the speculative method and whether vLLM starts processes of its
own for the engine (each imports vLLM again: about 24 of a 28-s start-up). conftest.py puts this folder on
PYTHONPATH (for `batchspec` subprocesses and probes) and calls :func:`install` (for engines built
in the test process) only when the variable is set; ``pytest`` then prints the counts per file.
Python imports the first ``sitecustomize`` on its path: any other one is run after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time

ENV = "BATCHSPEC_TEST_ENGINE_LOG"
_MODULE = "vllm.entrypoints.llm"


def _configuration(kwargs: dict, model) -> str:
    """A short name for the engine's whole configuration: its model, its speculation and a digest
    of every other argument, so that two start-ups of one configuration read the same."""
    import hashlib

    spec = kwargs.get("speculative_config") or {}
    if isinstance(spec, dict) and spec:
        drafter = os.path.basename(str(spec.get("model") or "")) or "-"
        spec_name = f"{spec.get('method')}:{drafter} k={spec.get('num_speculative_tokens')}"
    else:
        spec_name = "off" if not spec else str(spec)
    rest = {k: v for k, v in kwargs.items() if k not in ("model", "speculative_config")}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"{os.path.basename(str(model).rstrip('/'))} | {spec_name} | {digest}"


def _record(kwargs: dict, model) -> None:
    spec = kwargs.get("speculative_config") or {}
    line = json.dumps(
        {
            "config": _configuration(kwargs, model),
            # make test's lane (tools/run_tests.py), inherited by the lane's subprocesses
            "lane": os.environ.get("BATCHSPEC_TEST_LANE"),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
            "pid": os.getpid(),
            "time": round(time.time(), 1),
            "model": str(model),
            "speculative": spec.get("method") if isinstance(spec, dict) else str(spec),
            # vLLM's engine (and, on the CPU build, worker) processes, or none
            "separate": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        }
    )
    fd = os.open(os.environ[ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _wrap(module) -> None:
    llm = module.LLM
    if getattr(llm.__init__, "_batchspec_counted", False):
        return
    original = llm.__init__

    def __init__(self, *args, **kwargs):
        if os.environ.get(ENV):
            _record(kwargs, kwargs.get("model", args[0] if args else None))
        return original(self, *args, **kwargs)

    __init__._batchspec_counted = True
    llm.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps ``LLM.__init__`` as soon as vLLM's module that defines it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _wrap(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def install() -> None:
    """Count the engines this process builds (idempotent)."""
    if _MODULE in sys.modules:
        _wrap(sys.modules[_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path, which this module shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(ENV):
        install()
    _chain()
