"""Prompt templates (``input.prompt_template``, ``input.messages_template``): the spec's checks
(exit 2 naming the key, and the line), rendering in the sandbox, each row's errors, the bounds a
template cannot get past, and both readers (Parquet, JSON lines) on the fake engine."""

from __future__ import annotations

import copy
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.fake_runs import run
from helpers.jobs import write_parquet

from batchspec.errors import SpecError
from batchspec.io import template_bounds
from batchspec.io.templates import PromptTemplate
from batchspec.spec.build import build_spec
from batchspec.spec.fingerprint import spec_fingerprint

TEMPLATE = "Classify this ticket: {{ subject }} / {{ body }}. Answer with one of {{ labels | join(', ') }}."


def raw_spec(tmp_path, **input_keys) -> dict:
    return {
        "name": "t",
        "input": {"path": str(tmp_path / "in" / "*"), **input_keys},
        "output": {"path": str(tmp_path / "out")},
        "model": {"target": "unused"},
        "sampling": {"temperature": 0.0},
    }


def refused(raw: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        build_spec(raw)
    return info.value


def render(source: str, **values):
    return PromptTemplate(source, None).render(values)


# ------------------------------------------------------------------ the spec


def test_a_template_is_one_of_the_four_prompt_sources(tmp_path):
    spec = build_spec(raw_spec(tmp_path, prompt_template=TEMPLATE))
    assert spec.input.prompt_template == TEMPLATE and spec.input.text_column is None
    error = refused(raw_spec(tmp_path, prompt_template=TEMPLATE, prompt_column="prompt"))
    assert error.key == "input.prompt_template" and "prompt_column and prompt_template" in str(error)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{{ q }}"}]
    error = refused(raw_spec(tmp_path, messages_template=messages, messages_column="m"))
    assert error.key == "input.messages_template"
    assert build_spec(raw_spec(tmp_path, messages_template=messages)).input.messages_template == tuple(
        messages
    )


@pytest.mark.parametrize(
    "value, key, says",
    [
        ([], "input.messages_template", "list of {role, content}"),
        (["hi"], "input.messages_template[0]", "expected a mapping"),
        ([{"role": "user"}], "input.messages_template[0].content", "non-empty string"),
        ([{"role": "user", "content": "x", "name": "n"}], "input.messages_template[0].name", "unknown key"),
        ([{"role": "user", "content": "{{ x "}], "input.messages_template[0].content", "line 1"),
    ],
)
def test_a_bad_messages_template_names_its_key(tmp_path, value, key, says):
    error = refused(raw_spec(tmp_path, messages_template=value))
    assert error.key == key and says in str(error), str(error)


def test_templates_are_refused_with_openai_batch_input(tmp_path):
    for key, value in (
        ("prompt_template", TEMPLATE),
        ("messages_template", [{"role": "user", "content": "x"}]),
    ):
        error = refused(raw_spec(tmp_path, format="openai", **{key: value}))
        assert error.key == f"input.{key}" and "lines give their own" in str(error)


def test_a_template_that_is_not_jinja_exits_2_naming_the_key_and_the_line(tmp_path):
    error = refused(
        raw_spec(tmp_path, prompt_template="Subject: {{ subject }}\nBody: {% if body %}{{ body }")
    )
    assert error.exit_code == 2 and error.key == "input.prompt_template"
    assert "not a valid Jinja2 template: line 2" in str(error), str(error)
    error = refused(raw_spec(tmp_path, prompt_template="{{ body | nosuchfilter }}"))
    assert error.key == "input.prompt_template" and "'nosuchfilter'" in str(error)


@pytest.mark.parametrize(
    "source, says",
    [
        ("{{ body.__class__ }}", "attribute '__class__' is not available"),
        ("{{ body['__class__'] }}", "item '__class__' is not available"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "macros"),
        ("{% include 'other.txt' %}", "include, import or extend"),
        ("{% for x in l recursive %}{{ loop(x) }}{% endfor %}", "recursive loops"),
        ("{{ 2 ** 10 ** 10 }}", "the ** operator"),
        ("{{ body | center(10000000000) }}", "filter 'center' is not available"),
        ("{{ body | indent(10000000000) }}", "filter 'indent' is not available"),
        ("{{ body | random }}", "filter 'random' is not available"),
        ("{% set ns = namespace(s='') %}", "'namespace' is not available"),
        ("{{ lipsum(1000000) }}", "'lipsum' is not available"),
        ("{{ meta | tojson(indent=20000000) }}", "tojson takes no argument"),
        ("{{ meta | tojson(4) }}", "tojson takes no argument"),
        ("{{ lists | sum(start=[]) }}", "sum's start is not available"),
        ("{{ lists | sum('a', []) }}", "sum's start is not available"),
        ("{{ items | map('tojson', 20000000) | list }}", "tojson takes no argument"),
        ("{{ items | map('sum', start=[]) | list }}", "sum's start is not available"),
        ("{{ items | map('center', 10000000000) | list }}", "filter 'center' is not available"),
        ("{{ n | round(1000000000, 'floor') }}", "round to more than 32 digits"),
    ],
)
def test_what_no_bound_makes_safe_is_refused_at_load(tmp_path, source, says):
    error = refused(raw_spec(tmp_path, prompt_template="Ticket:\n" + source))
    assert error.exit_code == 2 and error.key == "input.prompt_template"
    assert says in str(error) and "line 2" in str(error), str(error)


@pytest.mark.parametrize(
    "source, required",
    [
        ("{{ body }}{% if note is defined %} ({{ note }}){% endif %}", ("body",)),
        ("{{ note | default('-') }} {{ note | d('-') }}", ()),
        ("{% if note is defined and note %}{{ note }}{% else %}{{ body }}{% endif %}", ("body",)),
        ("{% if note is undefined %}-{% elif note %}{{ note }}{% else %}{{ note }}{% endif %}", ()),
        ("{% if note is not defined %}-{% else %}{{ note }}{% endif %}", ()),
        ("{{ note if note is defined else body }}", ("body",)),
        ("{{ note is undefined or note }}", ()),
        # not guarded: a test that does not prove it defined, a use outside the guard, a field
        ("{% if note is defined or body %}{{ note }}{% endif %}", ("body", "note")),
        ("{% if note is defined %}{{ note }}{% endif %}{{ note }}", ("note",)),
        ("{{ meta.title | default('') }}", ("meta",)),
        ("{% if note %}{{ note }}{% endif %}", ("note",)),
        # a loop's own variable is not the column of the same name
        ("{{ note | default('') }}{% for note in notes %}{{ note }}{% endfor %}", ("notes",)),
    ],
)
def test_the_columns_an_input_must_have_are_those_read_without_a_guard(source, required):
    template = PromptTemplate(source, None)
    assert template.required == required
    assert set(required) <= set(template.columns)


def test_the_template_is_part_of_the_fingerprint(tmp_path):
    base = raw_spec(tmp_path, prompt_template=TEMPLATE)
    reworded = copy.deepcopy(base)
    reworded["input"]["prompt_template"] = TEMPLATE.replace("Classify", "Label")
    column = raw_spec(tmp_path, prompt_column="prompt")
    a, b, c = (spec_fingerprint(build_spec(r)) for r in (base, reworded, column))
    assert a["columns"] != b["columns"] and a["columns"] != c["columns"]
    assert {k for k in a if a[k] != b[k]} == {"columns"}
    # a job with a prompt column keeps the hash it had before templates existed
    assert "prompt_template" not in json.dumps(build_spec(column).public())


# ------------------------------------------------------------------ rendering


def test_columns_render_into_the_prompt():
    template = PromptTemplate(TEMPLATE, None)
    assert template.columns == ("body", "labels", "subject")
    prompt, error = template.render({"subject": "Login", "body": "It fails", "labels": ["bug", "question"]})
    assert error is None
    assert prompt == "Classify this ticket: Login / It fails. Answer with one of bug, question."


def test_a_null_cell_is_the_rows_error_unless_the_template_gives_a_default():
    assert render("{{ subject }} / {{ body }}", subject=None, body="b") == (
        None,
        "null cell in column 'subject': the template gives it no default",
    )
    assert render("{{ subject | default('n/a') }} / {{ body }}", subject=None, body="b") == ("n/a / b", None)
    assert render("{% if subject is defined %}{{ subject }}{% else %}-{% endif %}", subject=None) == (
        "-",
        None,
    )
    # a null inside a struct printed as it is
    prompt, error = render("{{ meta.title }}", meta={"title": None})
    assert prompt is None and "null" in error


def test_cells_of_other_types():
    # a list or a struct printed whole is JSON; their items and fields as they are
    assert render("{{ labels }} {{ meta }}", labels=["a", "b"], meta={"k": 1, "v": None}) == (
        '["a", "b"] {"k": 1, "v": null}',
        None,
    )
    assert render("{% for l in labels %}[{{ l }}]{% endfor %} {{ meta.k }}", labels=["a"], meta={"k": 2}) == (
        "[a] 2",
        None,
    )
    assert render("{{ n + 1 }} {{ x }}", n=41, x=1.5) == ("42 1.5", None)
    assert render("{{ blob }}", blob=b"\x00\x01") == (
        None,
        "binary cell in column 'blob': a template renders text",
    )
    prompt, error = render("{{ meta.nokey }}", meta={"k": 1})
    assert prompt is None and error.startswith("template error: ") and "nokey" in error


def test_chat_messages_render_each_content():
    template = PromptTemplate(
        None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{{ q }}"}]
    )
    assert template.render({"q": "Why?"}) == (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
        None,
    )


# ------------------------------------------------------------------ the bounds


def test_a_loop_that_runs_for_ever_is_stopped():
    started = time.monotonic()
    prompt, error = render(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", x=1
    )
    assert prompt is None and error == (
        f"template too costly: more than {template_bounds.MAX_LOOP_ITERATIONS:,} loop iterations"
    )
    prompt, error = render("{% for c in text %}{% for d in text %}{% endfor %}{% endfor %}", text="x" * 10**6)
    assert prompt is None and "loop iterations" in error
    prompt, error = render("{% for i in range(10000000000) %}x{% endfor %}", x=1)
    assert prompt is None and "range" in error
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * n }}",
        "{{ [1] * n }}",
        "{{ text * n }}",
        "{% set s = text ~ text %}" + "{% set s = s ~ s %}" * 4,
        "{{ text | replace('a', text) }}",
        "{{ text.replace('a', text) }}",
        "{{ parts | join(text) }}",
        "{{ text.join(parts) }}",
        "{% for p in parts %}{{ text }}{% endfor %}",
    ],
)
def test_a_template_that_builds_a_huge_string_is_stopped_before_it_allocates(source):
    started = time.monotonic()
    prompt, error = render(source, n=10**12, text="a" * 2**20, parts=["a"] * 2**12)
    assert prompt is None and error.startswith("template too costly: "), error
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "source, values",
    [
        # nested items count as work: each call reads all of them
        (
            "{% for i in range(20) %}{{ nested | max | length }}{% endfor %}",
            {"nested": [list(range(50))] * 50},
        ),
        (
            "{% for i in range(20) %}{% set s = nested | join(',') %}{% endfor %}x",
            {"nested": [["ab"] * 50] * 20},
        ),
        # an argument applied to each item counts once an item: select('in', other) is n * m
        ("{{ labels | select('in', other) | list | length }}", {"labels": ["x"] * 200, "other": ["y"] * 200}),
        # strip(chars) looks each stripped character up in chars
        ("{{ text | trim(chars) | length }}", {"text": "a" * 1000, "chars": "b" * 200 + "a"}),
        ("{{ text.strip(chars) | length }}", {"text": "a" * 1000, "chars": "b" * 200 + "a"}),
        # what an operator builds counts: a loop of 16 Mi-character values is not free
        ("{% for i in range(1000) %}{% set s = text * 100 %}{% endfor %}x", {"text": "ab"}),
        ("{% for i in range(1000) %}{% set s = text ~ text %}{% endfor %}x", {"text": "a" * 100}),
    ],
)
def test_work_counts_nested_items_arguments_and_what_is_built(monkeypatch, source, values):
    monkeypatch.setattr(template_bounds, "MAX_WORK", 10_000)

    prompt, error = render(source, **values)
    assert prompt is None and error.startswith("template too costly: "), error


def test_a_list_or_struct_is_measured_before_it_is_written_out_as_text(monkeypatch):
    import tracemalloc

    monkeypatch.setattr(template_bounds, "MAX_CHARS", 1000)
    # 1,000 references to one 1,000-character list: a million characters once written out
    values = {"labels": ["x" * 1000]}
    for source in ("{% set y = [labels] * 1000 %}{{ y }}", "{{ ([labels] * 1000) | tojson | length }}"):
        tracemalloc.start()
        try:
            prompt, error = render(source, **values)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (
            prompt is None and error == "template too costly: a value of more than 1,000 characters or items"
        )
        assert peak < 200_000, peak


def test_integers_and_round_are_bounded():
    started = time.monotonic()
    prompt, error = render("{% set n = 10 %}" + "{% set n = n * n %}" * 20 + "{{ n | length }}", x=1)
    assert error == f"template too costly: an integer of more than {template_bounds.MAX_INT_BITS:,} bits"
    prompt, error = render("{{ x | round(p, 'floor') }}", x=1.5, p=10**9)
    assert error == "template too costly: round to more than 32 digits"
    assert render("{{ x | round(2) }} {{ 12 * 12 }}", x=1.234) == ("1.23 144", None)
    assert time.monotonic() - started < 5


def test_a_filter_named_at_render_is_checked_as_at_load():
    prompt, error = render("{{ items | map(f, 20000000) | list }}", items=[{"a": 1}], f="tojson")
    assert prompt is None and error.startswith("template refused: tojson takes no argument"), error
    prompt, error = render("{{ items | map(f, none, []) | list }}", items=[[1], [2]], f="sum")
    assert error.startswith("template refused: sum's start is not available"), error
    assert render("{{ items | map(f) | join(',') }}", items=[[1], [2, 3]], f="sum") == ("1,5", None)


@pytest.mark.parametrize(
    "source, says",
    [
        ("{{ text['__cla' ~ 'ss__'] }}", "unsafe"),
        ("{{ text | attr('__class__') }}", "unsafe"),
        ("{{ '{0:>99999999999}'.format(text) }}", "calling 'format' is not available"),
        ("{{ text.center(10000000000) }}", "calling 'center' is not available"),
        ("{{ labels.append(1) }}", "unsafe"),
        ("{{ '%099999999999d' % 1 }}", "% formatting of text"),
    ],
)
def test_python_internals_and_unbounded_calls_are_the_rows_error(source, says):
    prompt, error = render(source, text="abc", labels=["a"])
    assert prompt is None and error.startswith("template refused: ") and says in error, error


def test_rendering_costs_microseconds():
    template = PromptTemplate(TEMPLATE, None)
    values = {"subject": "Login fails", "body": "It fails after the update. " * 8, "labels": ["a", "b", "c"]}
    started = time.perf_counter()
    for _ in range(2000):
        template.render(values)
    assert (time.perf_counter() - started) / 2000 < 1e-3


# ------------------------------------------------------------------ both readers


def _rows(tmp_path) -> dict[str, dict]:
    return {
        r["request_id"]: r for p in (tmp_path / "out").glob("*.parquet") for r in pq.read_table(p).to_pylist()
    }


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_parquet_and_json_lines_rows_render_and_a_null_cell_is_an_error_row(tmp_path):
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {
            "id": ["p0", "p1"],
            "subject": ["Login", None],
            "body": ["fails", "slow"],
            "labels": [["bug"], ["bug"]],
        },
    )
    lines = [
        {"id": "j0", "subject": "Export", "body": "empty", "labels": ["bug", "question"]},
        {"id": "j1", "subject": None, "body": "x", "labels": []},
        {"id": "j2", "body": "no subject key", "labels": []},
    ]
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    raw = raw_spec(tmp_path, prompt_template=TEMPLATE, id_column="id")
    result, _ = run(build_spec(raw))
    rows = _rows(tmp_path)
    assert set(rows) == {"p0", "p1", "j0", "j1", "j2"}
    # the fake engine echoes the prompt upper-cased
    assert rows["p0"]["generated_text"] == "CLASSIFY THIS TICKET: LOGIN / FAILS. ANSWER WITH ONE OF BUG."
    assert (
        rows["j0"]["generated_text"]
        == "CLASSIFY THIS TICKET: EXPORT / EMPTY. ANSWER WITH ONE OF BUG, QUESTION."
    )
    assert rows["p1"]["error"] == "null cell in column 'subject': the template gives it no default"
    assert rows["j1"]["error"] == "null cell in column 'subject': the template gives it no default: line 2"
    assert rows["j2"]["error"] == "null cell in column 'subject': the template gives it no default: line 3"
    # the columns the template read are kept (none of them is "the prompt column")
    assert {"subject", "body", "labels"} <= set(rows["p0"])


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_column_the_input_lacks_exits_2_before_any_row_is_read(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"subject": ["Login"], "text": ["fails"]})
    raw = raw_spec(tmp_path, prompt_template=TEMPLATE)
    with pytest.raises(SpecError) as info:
        run(build_spec(raw))
    assert info.value.exit_code == 2 and info.value.key == "input.prompt_template"
    assert "column 'body'" in str(info.value) and "(columns: subject, text)" in str(info.value)
    assert not list((tmp_path / "out").glob("*.parquet"))


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_json_lines_key_no_first_record_has_exits_2(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps({"subject": "s", "labels": []}) + "\n")
    with pytest.raises(SpecError) as info:
        run(build_spec(raw_spec(tmp_path, prompt_template=TEMPLATE)))
    assert info.value.key == "input.prompt_template" and "column 'body'" in str(info.value)


GUARDED = "{{ body }}{% if note is defined %} ({{ note }}){% endif %}"


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_guarded_json_lines_key_may_be_missing_from_the_first_records_or_all(tmp_path):
    (tmp_path / "in").mkdir()
    lines = [{"id": "a0", "body": "x"}, {"id": "a1", "body": "y", "note": "n"}, {"id": "a2", "body": "z"}]
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "in" / "b.jsonl").write_text(json.dumps({"id": "b0", "body": "w"}) + "\n")
    raw = raw_spec(tmp_path, prompt_template=GUARDED, id_column="id")
    raw["execution"] = {"read_batch_rows": 1}  # the first record alone settles the keys
    run(build_spec(raw))
    rows = _rows(tmp_path)
    assert {k: r["generated_text"] for k, r in rows.items()} == {
        "a0": "X",
        "a1": "Y (N)",
        "a2": "Z",
        "b0": "W",
    }
    assert all(r["error"] is None for r in rows.values())


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_guarded_parquet_column_may_be_missing_from_a_shard(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"body": ["x"]})
    write_parquet(tmp_path / "in" / "b.parquet", {"body": ["y", "z"], "note": ["n", None]})
    run(build_spec(raw_spec(tmp_path, prompt_template=GUARDED)))
    assert sorted(r["generated_text"] for r in _rows(tmp_path).values()) == ["X", "Y (N)", "Z"]


@pytest.mark.vllm  # runs a job: its checks import vLLM
def test_a_struct_and_a_binary_column(tmp_path):
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {
            "meta": pa.array([{"title": "T", "n": 1}, {"title": None, "n": 2}]),
            "blob": pa.array([b"x", b"y"], pa.binary()),
        },
    )
    run(build_spec(raw_spec(tmp_path, prompt_template="{{ meta.title | default('?', true) }} {{ meta.n }}")))
    rows = sorted(_rows(tmp_path).values(), key=lambda r: r["request_id"])
    assert [r["generated_text"] for r in rows] == ["T 1", "? 2"]
    run(
        build_spec(
            {**raw_spec(tmp_path, prompt_template="{{ blob }}"), "output": {"path": str(tmp_path / "o2")}}
        )
    )
    errors = [r["error"] for r in pq.read_table(next((tmp_path / "o2").glob("*.parquet"))).to_pylist()]
    assert errors == ["binary cell in column 'blob': a template renders text"] * 2


# ------------------------------------------------------------------ a pair's two texts (task: score)

PAIR = ["{{ q | trim }}", "{{ title }}{% if note is defined %} ({{ note }}){% endif %}: {{ body }}"]


def _pair_rows(tmp_path) -> dict[str, object]:
    from batchspec.io.listing import discover_shards
    from batchspec.io.reader import open_reader

    raw = {
        **raw_spec(tmp_path, pair_templates=PAIR, id_column="id"),
        "task": "score",
        "pooling": {"dimensions": 8},  # no model to read the size from, and no engine started
        "sampling": {},
    }
    spec = build_spec(raw)
    rows = {}
    for shard in discover_shards(spec.input.paths, {}, input_format=spec.input.format):
        rows.update({r.request_id: r for r in open_reader(shard, spec).rows()})
    return rows


def test_each_text_of_a_pair_renders_from_its_own_template_in_both_readers(tmp_path):
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {
            "id": ["p0", "p1", "p2", "p3"],
            "q": [" python ", "json", " ", "prose"],
            "title": ["Add", None, "T", "T"],
            "body": ["def add(a, b): ...", "{}", "x", "   "],
            "note": ["stdlib", None, None, None],
        },
    )
    lines = [
        {"id": "j0", "q": "python", "title": "Sum", "body": "sum(xs)"},
        {"id": "j1", "q": "json", "body": "{}"},
    ]
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = _pair_rows(tmp_path)
    assert (rows["p0"].prompt, rows["p0"].pair, rows["p0"].error) == (
        "python",
        "Add (stdlib): def add(a, b): ...",
        None,
    )
    assert (rows["j0"].prompt, rows["j0"].pair, rows["j0"].error) == ("python", "Sum: sum(xs)", None)
    assert rows["p1"].error == "null cell in column 'title': the template gives it no default"
    assert rows["j1"].error == "null cell in column 'title': the template gives it no default: line 2"
    assert rows["p2"].error == "empty pair text: input.pair_templates[0] renders only whitespace"
    assert rows["p3"].error is None and rows["p3"].pair == "T:    "  # a document of text around blanks


def test_a_column_a_pair_template_reads_that_the_input_lacks_exits_2_naming_the_key(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": ["p0"], "q": ["python"], "body": ["x"]})
    with pytest.raises(SpecError) as info:
        _pair_rows(tmp_path)
    assert info.value.key == "input.pair_templates" and "column 'title'" in str(info.value)
