"""MkDocs hook: README.md is the site's home page.

The README is written for the repository's front page, so its links start at the root
(``docs/job-spec.md``, ``BENCHMARKS.md``); on the site the home page sits in ``docs/``. This hook
adds ``index.md``, generated from the README at build time with those links made relative to
``docs/``. Any other relative link is left as it is, and ``mkdocs build --strict`` fails on it."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]

#: README link targets -> the same page on the site.
REWRITES = ((re.compile(r"\]\(docs/"), "]("), (re.compile(r"\]\(BENCHMARKS\.md"), "](benchmarks.md"))


def home_page() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    return text


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=home_page()))
    return files
