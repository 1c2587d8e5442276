"""The docs site and the front door.

The site is built as `make docs` builds it (`mkdocs build --strict`: a broken link or anchor, a
missing snippet, or a spec key or output column the code does not describe fails the build), then
opened in headless Chromium with an HTML report of a run on the fake engine: no console errors,
the report's charts drawn, the site's search and navigation working. The browser tests skip only
where Debian's `chromium` is not installed (`.ci/run` installs it)."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import importlib.util
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.chromium import Browser, chromium_binary
from helpers.fake_runs import make_spec, run, shards
from helpers.fakes import FakeEngine
from helpers.jobs import ROOT

from batchspec.columns import RESULT_NAMES
from batchspec.errors import exit_codes_markdown
from batchspec.spec import model

pytestmark = pytest.mark.docs

#: Every page of mkdocs.yml's nav, as the built site has it.
PAGES = (
    "",
    "job-spec",
    "inputs",
    "output",
    "requests",
    "images",
    "speculation",
    "scaling",
    "storage",
    "guarantees",
    "cpu-build",
    "development",
    "contract",
    "reference/spec",
    "reference/columns",
    "reference/cli",
    "reference/api",
    "architecture",
    "benchmarks",
    "storage-emulators",
    "vllm-cpu-rejection-sampler",
)


def load_hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A folder to serve: ``site/``, built as `make docs` builds it, and ``report.html``."""
    served = tmp_path_factory.mktemp("served")
    # a browser asks every server for one; the report, a single file, names none
    (served / "favicon.ico").write_bytes(b"")
    return served


@pytest.fixture(scope="module")
def site(served) -> Path:
    out = served / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-6000:]
    return out


# ---- the front door --------------------------------------------------------------------------


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200
    assert [n for n, line in enumerate(lines, 1) if len(line) > 200] == []
    first_code = lines.index("```bash")
    assert lines[first_code + 1].startswith("make demo") and lines[first_code + 2].startswith("make test")
    assert not any(line.startswith("## ") for line in lines[:first_code])


def test_readme_exit_codes_are_errors_py():
    """The README's table (which docs/contract.md includes) is batchspec/errors.py's EXIT_CODES,
    the one place the codes are written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    marker = "<!-- --8<-- [start:exit-codes] -->\n"
    start = readme.index(marker) + len(marker)
    table = readme[start : readme.index("\n\n", start) + 1]
    # to write it again: python -c "from batchspec.errors import *; print(exit_codes_markdown())"
    assert table == exit_codes_markdown()


# ---- the build -------------------------------------------------------------------------------


def test_site_builds_strict_with_every_page(site):
    for page in PAGES:
        assert (site / page / "index.html").is_file(), page
    home = (site / "index.html").read_text()
    assert "Run a job" in home and 'href="reference/spec/"' in home  # README, links made relative
    contract = (site / "contract" / "index.html").read_text()
    assert "130 / 143" in contract and "--8&lt;--" not in contract  # the README's exit codes
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "Tiny model pair" in benchmarks


def test_references_say_what_the_code_says(site):
    spec = (site / "reference" / "spec" / "index.html").read_text()
    hook = load_hook()
    for cls, prefix in (
        (model.InputSpec, "input."),
        (model.OutputSpec, "output."),
        (model.LoraSpec, "model.lora."),
        (model.ExecutionSpec, "execution."),
        (model.ExecutorSpec, "executor."),
        (model.AutoSpeculation, "speculative."),
    ):
        for f in dataclasses.fields(cls):
            key = prefix + hook.YAML_NAMES.get(f"{cls.__name__}.{f.name}", f.name)
            assert f'id="{key}"' in spec, key
    assert "67108864 (64 MiB)" in spec and "**required**" not in spec  # rendered, not raw
    columns = (site / "reference" / "columns" / "index.html").read_text()
    for name in RESULT_NAMES:
        assert f"<code>{name}</code>" in columns, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("run", "validate", "status", "report", "tune", "distill"):
        assert f"batchspec {command}" in cli, command
    assert "--worker-index" in cli
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "batchspec.run.job.run_job" in api and "batchspec.spec.load.load_spec" in api


def test_a_key_without_a_description_fails_the_build(monkeypatch):
    hook = load_hook()
    comments = hook.field_comments
    monkeypatch.setattr(
        hook,
        "field_comments",
        lambda path: {k: v for k, v in comments(path).items() if k != "ExecutionSpec.lease_s"},
    )
    with pytest.raises(hook.MissingDescription, match=r"execution\.lease_s"):
        hook.spec_markdown()
    described = hook.column_comments
    monkeypatch.setattr(
        hook,
        "column_comments",
        lambda path, ns, name=None: {k: v for k, v in described(path, ns, name).items() if k != "error"},
    )
    with pytest.raises(hook.MissingDescription, match="error"):
        hook.columns_markdown()


# ---- in a browser ----------------------------------------------------------------------------


class MeasuredFakeEngine(FakeEngine):
    """The fake engine, with speculative-decoding figures, timings and vLLM's per-position
    counters, so that every chart of the report has something to draw."""

    def __init__(self):
        super().__init__()
        self.figures = random.Random(1)
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_accepted_tokens_per_pos": [0, 0, 0, 0]}

    def stream(self, *args, **kwargs):
        for row, results in super().stream(*args, **kwargs):
            for r in results:
                if r["error"] is None:
                    self.measure(r)
            yield row, results

    def measure(self, r: dict) -> None:
        hist = [self.figures.randint(0, 5) for _ in range(5)]
        steps = sum(hist) or 1
        accepted = sum(j * h for j, h in enumerate(hist))
        e2e = self.figures.uniform(0.2, 2.0)
        r.update(
            spec_num_steps=steps,
            spec_num_draft_tokens=4 * steps,
            spec_num_accepted_tokens=accepted,
            spec_acceptance_rate=accepted / (4 * steps),
            spec_mean_acceptance_length=1 + accepted / steps,
            spec_acceptance_histogram=hist,
            time_queued_s=0.01,
            time_to_first_token_s=e2e / 5,
            time_decode_s=e2e * 0.8,
            time_e2e_s=e2e,
            output_tokens_per_s=r["num_output_tokens"] / (e2e * 0.8),
        )
        self.counters["spec_decode_num_drafts"] += steps
        per_pos = self.counters["spec_decode_num_accepted_tokens_per_pos"]
        for j, h in enumerate(hist):
            for position in range(j):
                per_pos[position] += h

    def spec_counters(self):
        return {
            **self.counters,
            "spec_decode_num_accepted_tokens_per_pos": list(
                self.counters["spec_decode_num_accepted_tokens_per_pos"]
            ),
        }


@pytest.fixture(scope="module")
def report_html(served, tmp_path_factory) -> str:
    """`batchspec report --html` of a run on the fake engine, written beside the site."""
    from batchspec.report.html import render_html
    from batchspec.report.metrics import summarize
    from batchspec.report.read import load_output

    work = tmp_path_factory.mktemp("run")
    shards(work, n=3, rows=12)
    run(make_spec(work), engine=MeasuredFakeEngine())
    output = load_output(str(work / "out"))
    html = render_html(summarize(output), [output])
    (served / "report.html").write_text(html, encoding="utf-8")
    return html


@pytest.fixture(scope="module")
def server(served, site, report_html):
    """The served folder over HTTP on 127.0.0.1 (the site's search runs in a worker, which a
    file:// page may not start)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run does)")
    browser = Browser(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


def test_report_charts_are_drawn(browser, server, report_html):
    page = browser.open(f"{server}/report.html")
    browser.settle(0.5)
    charts = page.evaluate("document.querySelectorAll('svg').length")
    assert charts == report_html.count("<svg") >= 7  # every chart has data, none is "off"
    # each chart laid out on the page, with marks in it
    sizes = page.evaluate(
        "[...document.querySelectorAll('svg')].map(s => "
        "[s.getBoundingClientRect().width, s.getBoundingClientRect().height, "
        "s.querySelectorAll('rect, circle, path, line, polyline').length])"
    )
    assert all(w > 100 and h > 50 and marks > 0 for w, h, marks in sizes), sizes
    assert page.errors == []


def test_site_renders_with_navigation_and_search(browser, server):
    page = browser.open(f"{server}/site/")
    nav = page.evaluate(
        "[...document.querySelectorAll('nav.md-nav--primary a.md-nav__link')].map(a => a.textContent.trim())"
    )
    for title in (
        "The job spec",
        "What is guaranteed",
        "Job spec keys",
        "Command line",
        "Python API",
        "Benchmarks",
    ):
        assert title in nav, nav
    page.evaluate("document.querySelector('input.md-search__input').focus()")
    page.insert_text("exit codes")
    found = page.wait_for(
        "[...document.querySelectorAll('.md-search-result__item')].map(li => li.textContent)", timeout_s=15
    )
    assert any("Exit codes" in item for item in found), found
    assert page.errors == []

    page = browser.open(f"{server}/site/reference/spec/")
    assert page.evaluate("document.querySelectorAll('article h3').length") >= 40
    browser.settle(0.5)
    assert page.errors == []
