"""The installed vLLM's version: below both ``checks.py`` and ``reasoning.py``, which each name it
in what they write, so that neither imports the other for it."""

from __future__ import annotations


def vllm_version() -> str:
    import vllm

    return vllm.__version__
