"""The bounds of a prompt template, tried as an attacker would: every operation whose cost grows
with a value's size counts against the row's work, a row over it is that row's error within about
a second, and a stop ends a render at once; a struct field named like a method is the field, and a
method never reaches a prompt; a template nested too deeply to compile is exit 2 naming its key."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time

import pytest
from helpers.fakes import fake_cli_command
from helpers.jobs import ROOT, write_job, write_parquet
from helpers.recovery import Job

from batchspec.errors import SpecError
from batchspec.io import template_bounds
from batchspec.io.templates import PromptTemplate
from batchspec.spec.build import build_spec


def render(source: str, **values):
    return PromptTemplate(source, None).render(values)


def too_costly(result) -> bool:
    prompt, error = result
    return prompt is None and error is not None and error.startswith("template too costly: ")


# ------------------------------------------------------------------ every costly operation counted


@pytest.mark.parametrize(
    "source",
    [
        "{% set x %}" + "{{ v }}" * 200 + "{% endset %}{{ x | length }}",
        "{% filter upper %}" + "{{ v }}" * 200 + "{% endfilter %}",
        "{% set x %}{% for i in range(200) %}{{ v }}{% endfor %}{% endset %}{{ x | length }}",
    ],
    ids=["set block", "filter block", "loop in a set block"],
)
def test_a_block_body_is_capped_before_it_is_joined(source):
    """200 copies of an allowed value would be a 200 Mi-character string (3.1 GB reported)."""
    started = time.monotonic()
    result = render(source, v="a" * 2**20)
    assert result == (
        None,
        f"template too costly: a value of more than {template_bounds.MAX_CHARS:,} characters or items",
    )
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "source, values",
    [
        # a block's body: what it builds counts, again at each iteration
        ("{% for i in range(100) %}{% set x %}{{ v }}{% endset %}{% endfor %}x", {"v": "a" * 200}),
        ("{% for i in range(100) %}{% filter upper %}{{ v }}{% endfilter %}{% endfor %}", {"v": "a" * 200}),
        # a comparison reads both sides, nested items included
        ("{% for i in range(100) %}{{ -1 in l }}{% endfor %}", {"l": [0] * 1000}),
        ("{% for i in range(100) %}{{ 'b' not in t }}{% endfor %}", {"t": "a" * 1000}),
        ("{% for i in range(100) %}{{ l == m }}{% endfor %}", {"l": [0] * 1000, "m": [0] * 1000}),
        ("{% for i in range(100) %}{{ l < m }}{% endfor %}", {"l": [[0] * 10] * 100, "m": [[0] * 10] * 100}),
        # so does a test
        ("{% for i in range(100) %}{{ -1 is in l }}{% endfor %}", {"l": [0] * 1000}),
        ("{% for i in range(100) %}{{ l is eq m }}{% endfor %}", {"l": [0] * 1000, "m": [0] * 1000}),
        # a slice builds a copy
        ("{% for i in range(100) %}{% set y = l[::-1] %}{% endfor %}x", {"l": [0] * 1000}),
        ("{% for i in range(100) %}{% set y = t[1:] %}{% endfor %}x", {"t": "a" * 1000}),
        # sorting is n log n comparisons
        ("{{ l | sort | length }}", {"l": list(range(2000))}),
        # each call costs something, however small its input
        ("{% for i in range(5000) %}{{ t | upper }}{% endfor %}", {"t": ""}),
        ("{{ l | map('upper') | list | length }}", {"l": [""] * 5000}),
    ],
)
def test_every_operation_that_grows_with_a_value_counts_as_work(monkeypatch, source, values):
    monkeypatch.setattr(template_bounds, "MAX_WORK", 10_000)
    result = render(source, **values)
    assert too_costly(result), result


def test_what_a_prompt_needs_stays_well_within_the_bounds():
    source = (
        "{% set head %}{{ subject | title }}: {{ body[:200] }}{% endset %}{{ head }}"
        "{% if 'bug' in labels and labels != [] %} [bug]{% endif %}"
        "{% for l in labels | sort %}{{ l }}{% if not loop.last %}, {% endif %}{% endfor %}"
    )
    values = {"subject": "login", "body": "It fails. " * 1000, "labels": ["z", "bug", "a"]}
    prompt, error = render(source, **values)
    assert error is None and prompt.startswith("Login: It fails.") and prompt.endswith("[bug]a, bug, z")


#: Renders each named case in a fresh process: (its error, the CPU seconds it took). A process, so
#: that a render that never ends can be killed, and CPU time, so that a loaded machine is no excuse.
RENDER_CHILD = """
import json, sys, time
from batchspec.io.templates import PromptTemplate
source, values = sys.argv[1], eval(sys.argv[2])
started = time.process_time()
prompt, error = PromptTemplate(source, None).render(values)
print(json.dumps([error, time.process_time() - started]))
"""


@pytest.mark.parametrize(
    "source, values",
    [
        (
            "{% for i in range(100000) %}{{ -1 in l }}{% endfor %}",
            "{'l': [0] * 2**22}",
        ),
        (
            "{% for i in range(100000) %}{% set y = l[::-1] %}{% endfor %}x",
            "{'l': [0] * 2**22}",
        ),
        (
            "{% set l = [0] * 16777216 %}{% for i in range(100000) %}{{ l == l[:] }}{% endfor %}",
            "{}",
        ),
        ("{% set x %}" + "{{ v }}" * 200 + "{% endset %}{{ x | length }}", "{'v': 'a' * 2**24}"),
        (
            "{% for i in range(100000) %}{% set x %}{{ v }}{% endset %}{% endfor %}x",
            "{'v': 'a' * 2**23}",
        ),
        ("{{ l | map('upper') | list | length }}", "{'l': [''] * 2**24}"),
        ("{{ l | sort | length }}", "{'l': list(range(2**22, 0, -1))}"),
    ],
    ids=["in", "slice", "equal", "set block", "set block in a loop", "map", "sort"],
)
def test_the_reported_costly_rows_end_as_their_error_within_a_second(source, values):
    """Hours a row before, as the issue reported them: each is now the row's error, in a second
    or so of the row's own CPU time."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", RENDER_CHILD, source, values],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the render did not end in 60 s")
    assert done.returncode == 0, done.stderr[-3000:]
    error, seconds = json.loads(done.stdout)
    assert error is not None and error.startswith("template too costly: "), error
    assert seconds < 2.0, f"{seconds:.2f} s of CPU to refuse the row"


def test_a_stop_ends_a_render_in_progress():
    """A stopping run drops the rows it reads after the stop: a render in progress gives up at
    its next step."""
    checks = itertools.count()
    template = PromptTemplate("{% for i in range(100000) %}{{ -1 in l }}{% endfor %}", None)
    previous = template_bounds.interrupt_renders(lambda: next(checks) > 1000)
    try:
        result = template.render({"l": [0] * 100})
    finally:
        template_bounds.interrupt_renders(previous)
    assert result == (None, "template not rendered: the run is stopping")
    assert next(checks) < 1010
    assert PromptTemplate("{{ 1 in l }}", None).render({"l": [1]}) == ("True", None)


#: A row over the work budget (its error in about a second) and a row within it (a third of a
#: second or so, and fine: the prefix window holds such rows until it has 1,024 of them).
COSTLY_ROWS = {
    "over the budget": "{{ k }}{% set l = [0] * 4000000 %}"
    "{% for i in range(100000) %}{{ -1 in l }}{% endfor %}",
    "within the budget": "{{ k }}{% set l = [0] * 100 %}"
    "{% for i in range(30000) %}{% if -1 in l %}x{% endif %}{% endfor %}",
}


@pytest.mark.vllm  # a run checks its spec against vLLM's classes (stubbed by the fake engine's CLI)
@pytest.mark.parametrize("template", COSTLY_ROWS.values(), ids=COSTLY_ROWS.keys())
def test_sigterm_during_costly_rows_is_honoured_within_the_grace_period(tmp_path, template):
    """A run SIGTERMed while it renders costly rows, with 1 s of grace, exits 143 at once (it
    ignored SIGTERM for over 90 s, until a SIGKILL), and commits nothing partial."""
    write_parquet(tmp_path / "in" / "a.parquet", {"k": list(range(60))})
    job = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_template": template},
        output={"path": str(tmp_path / "out")},
        sampling={"temperature": 0.0, "max_tokens": 8},
    )
    run = Job(job, "--grace-seconds", "1", fake_engine=True)
    assert run.wait_for("shard_started", timeout=120) is not None, run.stderr[-3000:]
    time.sleep(1.0)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    try:
        rc = run.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("SIGTERM was not honoured in 30 s")
    assert rc == 143, run.stderr[-3000:]
    assert time.monotonic() - sent < 1 + 4
    assert not list((tmp_path / "out").glob("*.parquet"))


# ------------------------------------------------------------------ fields, not methods


@pytest.mark.parametrize("name", ["items", "keys", "values", "get", "copy", "pop", "update"])
def test_a_struct_field_named_like_a_method_is_its_value(name):
    meta = {name: f"the {name} field"}
    for source in (f"{{{{ meta.{name} }}}}", f"{{{{ meta['{name}'] }}}}", f"{{{{ meta | attr('{name}') }}}}"):
        assert render(source, meta=meta) == (f"the {name} field", None), source
    assert render(f"{{{{ rows | map(attribute='{name}') | join(',') }}}}", rows=[meta, meta]) == (
        f"the {name} field,the {name} field",
        None,
    )
    assert render(f"{{% if meta.{name} is defined %}}yes{{% endif %}}", meta=meta) == ("yes", None)


def test_methods_are_still_called():
    assert render(
        "{{ meta.get('k') }} {{ meta.items() | list | length }} {{ t.title() }}", meta={"k": 1}, t="ab"
    ) == (
        "1 1 Ab",
        None,
    )
    # a struct with a field named like the method: calling it calls the method
    assert render("{{ meta.get('k') }}", meta={"get": "field", "k": 2}) == ("2", None)


@pytest.mark.parametrize(
    "source",
    [
        "{{ meta.title }}",
        "{{ meta['title'] }}",
        "{{ meta | attr('title') }}",
        "{{ meta.title ~ '' }}",
        "{{ [meta.title] }}",
        "{{ meta.title | upper }}",
        "{{ meta.title | string }}",
        "{{ {'k': meta.title} | tojson }}",
        "{{ other.items }}",
        "{{ other.keys | list }}",
        "{{ other['get'] }}",
        "{{ loop_free.upper }}",
    ],
)
def test_a_method_read_as_a_field_is_the_rows_error(source):
    """A string has no fields (``title`` is ``str.title``), nor a struct a field it lacks: the
    row's error, never ``<built-in method ...>`` in a prompt."""
    prompt, error = render(source, meta="a string column", other={"k": 1}, loop_free="x")
    assert prompt is None and error.startswith("template error: "), (prompt, error)
    assert "built-in method" not in error


@pytest.mark.parametrize("source", ["{{ range }}", "{{ [dict] }}", "{{ range ~ '' }}"])
def test_a_function_is_never_printed(source):
    assert render(source) == (
        None,
        "template error: it prints a function or a method (a method is to be called)",
    )


def test_a_method_read_as_a_field_is_undefined_to_a_guard():
    assert render("{{ meta.title | default('-') }}", meta="abc") == ("-", None)
    assert render("{% if meta.title is defined %}y{% else %}n{% endif %}", meta="abc") == ("n", None)


def test_loop_fields_still_read():
    source = "{% for x in l %}{{ loop.index }}/{{ loop.length }}{{ loop.cycle('a', 'b') }} {% endfor %}"
    assert render(source, l=[1, 2]) == ("1/2a 2/2b ", None)


# ------------------------------------------------------------------ nested too deeply to compile


def _raw(tmp_path, **input_keys) -> dict:
    return {
        "name": "t",
        "input": {"path": str(tmp_path / "in" / "*"), **input_keys},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0},
    }


DEEP = {
    "5,000 parentheses": "{{ " + "(" * 5000 + "x" + ")" * 5000 + " }}",
    "3,000 ifs": "{% if x %}" * 3000 + "y" + "{% endif %}" * 3000,
    "200 fors": "{% for a in x %}" * 200 + "y" + "{% endfor %}" * 200,
    "25 fors": "{% for a in x %}" * 25 + "y" + "{% endfor %}" * 25,
    "300 filters": "{{ x" + " | upper" * 300 + " }}",
    "300 negations": "{{ " + "-" * 300 + "x }}",
    "300 lists": "{{ " + "[" * 300 + "x" + "]" * 300 + " }}",
    "300 attributes": "{{ x" + ".a" * 300 + " }}",
}


@pytest.mark.parametrize("source", DEEP.values(), ids=DEEP.keys())
def test_a_template_nested_too_deeply_is_exit_2_naming_its_key(tmp_path, source):
    started = time.monotonic()
    with pytest.raises(SpecError) as info:
        build_spec(_raw(tmp_path, prompt_template=source))
    assert info.value.exit_code == 2 and info.value.key == "input.prompt_template"
    assert "nested too deeply" in str(info.value), str(info.value)
    messages = [{"role": "system", "content": "Hi."}, {"role": "user", "content": source}]
    with pytest.raises(SpecError) as info:
        build_spec(_raw(tmp_path, messages_template=messages))
    assert info.value.key == "input.messages_template[1].content"
    assert time.monotonic() - started < 5


def test_nesting_a_template_needs_compiles(tmp_path):
    source = "{% for a in x %}{% for b in a %}{% if b %}{{ (b | upper | trim) ~ ((1 + 2) * 3) }}{% endif %}"
    build_spec(_raw(tmp_path, prompt_template=source + "{% endfor %}{% endfor %}"))


def test_validate_exits_2_on_a_template_nested_too_deeply(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_raw(tmp_path, prompt_template=DEEP["5,000 parentheses"])))
    done = subprocess.run(
        fake_cli_command("validate", str(job)), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "input.prompt_template" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
