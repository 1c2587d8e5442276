"""What each optional per-row feature costs the runner, in CPU time per row, with no engine.

The runner's own per-row work with its features off is about 1% of a run (BENCHMARKS.md, "Runner
overhead"); this measures what each feature adds to it, by calling batchspec's own functions the
way the run calls them, once per row, over ``--rows`` rows (a pool of distinct rows, cycled):

- ``templates``: the reader turning a row's values into a :class:`~batchspec.io.rows.Row`
  (``ParquetReader._row``, which ``rows()`` calls per row) with ``input.prompt_template`` (a
  conditional and a loop) and with docs/templates.md's ``input.messages_template``, against the
  same rows with a precomputed ``prompt_column``; the difference is the render.
- ``reasoning``: ``Splitter.split`` (vLLM's ``qwen3`` parser over ``.models/reasoner``'s
  tokenizer) on outputs of 200 thinking and 50 answer tokens, as ``engine/rows.py`` turns each
  output into a result row; and ``Splitter.prompt_ends_thinking`` on a chat row, as the engine
  prepares each request (a text prompt skips it).
- ``structured``: ``check_answer`` on a valid compact JSON answer (six properties: an enum, a
  boolean, a bounded number and string, a list of patterned strings, a nested object) and on a
  regex constraint's output, as each finished output is checked; and ``Engine.sampling_params``
  with the job's constraint against without (the request's ``StructuredOutputsParams``; the
  constraint's one compile, cached for the process, is done before the clock).
- ``typed_answers``: ``output.parse_json``'s ``AnswerColumn.fill`` for the same schema, as each result
  row is written; and the shard's ``ParquetWriter`` (``add_request`` and its row-group flushes)
  with the typed ``answer`` column against without it.

Each measure runs ``--repeats`` times (a pair's two sides alternate within a repeat), each
function called once before the clock; reported: the median µs per row, min and max, and for a
pair the difference of the medians.

Usage: ``python benchmarks/feature_costs.py [--rows 20000] [--repeats 5] [--only templates ...]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import print_report  # noqa: E402

FEATURES = ("templates", "reasoning", "structured", "typed_answers")
REASONER = ROOT / ".models" / "reasoner"
#: Distinct rows in the pool each measure cycles through.
POOL = 256

PROMPT_TEMPLATE = """Classify this support ticket.
Subject: {{ subject }}
{% if body is defined %}Body: {{ body }}{% else %}Body: (no body){% endif %}
Labels seen so far: {% for l in labels %}{{ l }}{% if not loop.last %}, {% endif %}{% endfor %}
Answer with a JSON object: label is one of bug, question, feature; urgent is true or false.
"""
#: docs/templates.md's example.
MESSAGES_TEMPLATE = [
    {"role": "system", "content": "You label support tickets."},
    {
        "role": "user",
        "content": "Subject: {{ subject }}\n{{ body | default('(no body)') }}\n"
        "Labels: {{ labels | join(', ') }}\n",
    },
]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["bug", "question", "feature"]},
        "urgent": {"type": "boolean"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "summary": {"type": "string", "maxLength": 200},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z][a-z0-9-]*$"},
            "maxItems": 8,
        },
        "contact": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "ticket": {"type": "integer"}},
            "required": ["name"],
        },
    },
    "required": ["label", "urgent", "confidence", "summary", "tags"],
    "additionalProperties": False,
}
REGEX = r"(bug|question|feature): [A-Za-z ,.'-]{1,80}\. Ticket [A-Z]{3}-\d{4,6}"
SAMPLING = {"temperature": 0.0, "max_tokens": 128}
WORDS = (
    "login page fails after update error shown when saving the report export stops at half "
    "customer cannot reset password invoice total is wrong dark mode request please add "
    "the app crashes on start sync takes hours search returns nothing for quoted terms"
).split()
TAGS = ("auth", "billing", "ui", "sync", "export", "mobile", "api", "search")


def stats(seconds: Sequence[float], rows: int) -> dict:
    us = [s / rows * 1e6 for s in seconds]
    return {
        "median_us": round(statistics.median(us), 3),
        "min_us": round(min(us), 3),
        "max_us": round(max(us), 3),
    }


def loop_seconds(call: Callable[[Any], Any], work: list) -> float:
    """Seconds to call ``call`` on each item of ``work``, one by one."""
    gc.collect()
    started = time.perf_counter()
    for item in work:
        call(item)
    return time.perf_counter() - started


def measure(sides: dict[str, Callable[[], float]], repeats: int, rows: int) -> dict:
    """Each side's timing function run ``repeats`` times, the sides alternating: one side's
    stats, or each side's and, with two, the second's median minus the first's (what the
    feature adds)."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            seconds[name].append(run())
    out: dict[str, Any] = {name: stats(s, rows) for name, s in seconds.items()}
    if len(sides) == 1:
        return next(iter(out.values()))
    if len(sides) == 2:
        off, on = (out[name]["median_us"] for name in sides)
        out["added_us"] = round(on - off, 3)
    return out


def cycled(pool: Sequence, rows: int) -> list:
    return [pool[i % len(pool)] for i in range(rows)]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def tickets(count: int, seed: int) -> list[dict]:
    """Input rows: ``id``, ``subject``, ``body`` (a tenth null), ``labels`` (a list)."""
    rng = random.Random(seed)
    return [
        {
            "id": f"t{i}",
            "subject": sentence(rng, 8).capitalize(),
            "body": None if i % 10 == 9 else sentence(rng, 60).capitalize() + ".",
            "labels": rng.sample(["bug", "question", "feature", "billing", "ui"], 3),
        }
        for i in range(count)
    ]


def answers_pool(count: int, seed: int) -> list[dict]:
    """Valid answers to :data:`SCHEMA`."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        answer = {
            "label": rng.choice(["bug", "question", "feature"]),
            "urgent": rng.random() < 0.3,
            "confidence": round(rng.random(), 3),
            "summary": sentence(rng, 20).capitalize()[:200],
            "tags": rng.sample(TAGS, rng.randint(1, 4)),
        }
        if i % 2:
            answer["contact"] = {"name": "Ada Lovelace", "ticket": rng.randint(1000, 99999)}
        out.append(answer)
    return out


def raw_spec(work: Path, **changes) -> dict:
    raw = {
        "name": "bench-feature-costs",
        "input": {"path": str(work / "in" / "*.parquet"), "id_column": "id", "prompt_column": "prompt"},
        "output": {"path": str(work / "out"), "keep_columns": ["id"]},
        "model": {"target": str(REASONER)},
        "sampling": dict(SAMPLING),
        "execution": {"dedupe_window": 0},
    }
    for section, values in changes.items():
        raw[section] = {**raw[section], **values}
    return raw


def write_input(work: Path, rows: list[dict]) -> None:
    """The pool as one Parquet shard, with the prompt each template would render precomputed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.io.templates import PromptTemplate

    template = PromptTemplate(PROMPT_TEMPLATE, None)
    prompts = []
    for row in rows:
        prompt, why = template.render(row)
        assert why is None, why
        prompts.append(prompt)
    (work / "in").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist([{**r, "prompt": p} for r, p in zip(rows, prompts, strict=True)]),
        work / "in" / "part-0.parquet",
    )


def reader_of(spec):
    """The shard's reader for ``spec``, and each row's values as ``rows()`` hands them to ``_row``."""
    import pyarrow.parquet as pq

    from batchspec.io.listing import discover_shards
    from batchspec.io.reader import open_reader

    (shard,) = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    reader = open_reader(shard, spec)
    values = pq.read_table(shard.path, columns=reader.columns, filesystem=shard.fs).to_pylist()
    return shard, reader, values


def templates(work: Path, rows: int, repeats: int) -> dict:
    from batchspec.spec.build import build_spec

    plain = build_spec(raw_spec(work))
    specs = {
        "prompt_template": build_spec(
            raw_spec(work, input={"prompt_column": None, "prompt_template": PROMPT_TEMPLATE})
        ),
        "messages_template": build_spec(
            raw_spec(work, input={"prompt_column": None, "messages_template": MESSAGES_TEMPLATE})
        ),
    }
    sources = {"prompt_template": PROMPT_TEMPLATE, "messages_template": MESSAGES_TEMPLATE}

    def side(spec):
        _, reader, values = reader_of(spec)
        work_items = cycled(list(enumerate(values)), rows)
        made = reader._row(0, values[0], spec.input)
        assert made.error is None and (made.prompt or made.messages), made
        return lambda: loop_seconds(lambda item: reader._row(item[0], item[1], spec.input), work_items)

    column = side(plain)
    return {
        name: {
            "source": sources[name],
            **measure({"prompt_column": column, "template": side(spec)}, repeats, rows),
        }
        for name, spec in specs.items()
    }


def reasoning(rows: int, repeats: int) -> dict:
    from tiny_models import held_out_snippets
    from transformers import AutoTokenizer

    from batchspec.engine.reasoning import Splitter

    tok = AutoTokenizer.from_pretrained(REASONER)
    splitter = Splitter("qwen3", tok)
    source = [
        i for s in held_out_snippets(600, seed=11) for i in tok(s, add_special_tokens=False)["input_ids"]
    ]
    outputs = []
    for k in range(min(POOL, len(source) // 250)):
        thinking = tok.decode(source[k * 250 : k * 250 + 200])
        answer = tok.decode(source[k * 250 + 200 : k * 250 + 250])
        output = f"<think>\n{thinking}\n</think>\n\n{answer}"
        outputs.append((tok(output, add_special_tokens=False)["input_ids"], output))
    splits = [splitter.split(False, ids, output) for ids, output in outputs]
    assert all(s.ended and s.answer for s in splits)
    chats = [[{"role": "user", "content": s}] for s in held_out_snippets(POOL, seed=12)]
    assert not splitter.prompt_ends_thinking(chats[0], {})
    split_work, chat_work = cycled(outputs, rows), cycled(chats, rows)
    return {
        "parser": "qwen3",
        "output_tokens": {
            "mean": round(statistics.mean(len(ids) for ids, _ in outputs), 1),
            "thinking_mean": round(statistics.mean(s.reasoning_tokens for s in splits), 1),
        },
        "split": measure(
            {"on": lambda: loop_seconds(lambda o: splitter.split(False, o[0], o[1]), split_work)},
            repeats,
            rows,
        ),
        "prompt_ends_thinking_chat_row": measure(
            {"on": lambda: loop_seconds(lambda m: splitter.prompt_ends_thinking(m, {}), chat_work)},
            repeats,
            rows,
        ),
    }


def structured(rows: int, repeats: int) -> dict:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from batchspec.engine import structured as constraints
    from batchspec.engine.llm import Engine

    schema = constraints.normalise({"json": SCHEMA})
    regex = constraints.normalise({"regex": REGEX})
    texts = [json.dumps(a, separators=(",", ":")) for a in answers_pool(POOL, seed=13)]
    rng = random.Random(14)
    matches = [
        f"{rng.choice(['bug', 'question', 'feature'])}: {sentence(rng, 8).capitalize()}. "
        f"Ticket ABC-{rng.randint(1000, 999999)}"
        for _ in range(POOL)
    ]
    assert constraints.check_answer(schema, texts[0], "stop")[0]
    assert constraints.check_answer(regex, matches[0], "stop")[0]

    def engine(constraint):  # what Engine.sampling_params reads of the engine
        return SimpleNamespace(
            base_constraint=constraint,
            base_sampling=dict(SAMPLING),
            max_logprobs=20,
            max_n=None,
            _SamplingParams=SamplingParams,
            _final_only=RequestOutputKind.FINAL_ONLY,
        )

    plain, constrained = engine(None), engine(schema)
    # the first request compiles the constraint as vLLM would (once a process, cached): not per row
    assert Engine.sampling_params(constrained, {})[1].constraint == schema
    overrides = cycled([{}], rows)
    json_work, regex_work = cycled(texts, rows), cycled(matches, rows)
    return {
        "schema": json.dumps(SCHEMA, separators=(",", ":")),
        "answer_chars": round(statistics.mean(map(len, texts)), 1),
        "regex": REGEX,
        "check_json": measure(
            {"on": lambda: loop_seconds(lambda t: constraints.check_answer(schema, t, "stop"), json_work)},
            repeats,
            rows,
        ),
        "check_regex": measure(
            {"on": lambda: loop_seconds(lambda t: constraints.check_answer(regex, t, "stop"), regex_work)},
            repeats,
            rows,
        ),
        "request_params": measure(
            {
                "no_constraint": lambda: loop_seconds(lambda o: Engine.sampling_params(plain, o), overrides),
                "json_schema": lambda: loop_seconds(
                    lambda o: Engine.sampling_params(constrained, o), overrides
                ),
            },
            repeats,
            rows,
        ),
    }


def typed_answers(work: Path, rows: int, repeats: int) -> dict:
    from batchspec.columns import empty_result
    from batchspec.engine.structured import check_answer, normalise
    from batchspec.io.answers import answer_column
    from batchspec.io.output_dir import OutputDir
    from batchspec.io.output_formats import output_fields, result_fields
    from batchspec.spec.build import build_spec

    constrained = {"structured_outputs": {"json": SCHEMA}}
    specs = {
        "no_answer_column": build_spec(raw_spec(work, sampling=constrained)),
        "answer_column": build_spec(raw_spec(work, sampling=constrained, output={"parse_json": True})),
    }
    answers = answer_column(specs["answer_column"])
    constraint = normalise({"json": SCHEMA})
    results = []
    for answer in answers_pool(POOL, seed=13):
        text = json.dumps(answer, separators=(",", ":"))
        result = empty_result()
        result.update(generated_text=text, finish_reason="stop", num_prompt_tokens=60, num_output_tokens=70)
        valid, why, parsed = check_answer(constraint, text, "stop")
        result.update(structured_valid=valid, structured_error=why, _answer=parsed)
        results.append(result)
    answers.fill(results[0])
    assert results[0]["answer"] is not None and results[0]["structured_error"] is None, results[0]
    fill_work = cycled(results, rows)
    for result in results:
        answers.fill(result)

    out = OutputDir(str(work / "out"), {})

    def writer_side(spec):
        shard, reader, values = reader_of(spec)
        made = [reader._row(i, v, spec.input) for i, v in enumerate(values[:POOL])]
        kept = output_fields(spec, reader.kept_fields)
        pairs = cycled([(row, [results[i % len(results)]]) for i, row in enumerate(made)], rows)

        def run() -> float:
            writer = out.format.writer(out, shard, spec.output, kept, {}, result_fields(spec))
            gc.collect()
            try:
                started = time.perf_counter()
                for row, result in pairs:
                    writer.add_request(row, result)
                writer.flush()
                return time.perf_counter() - started
            finally:
                writer.discard()

        return run

    return {
        "arrow_type": str(answers.field.type),
        "fill": measure({"on": lambda: loop_seconds(answers.fill, fill_work)}, repeats, rows),
        "writer": measure({name: writer_side(spec) for name, spec in specs.items()}, repeats, rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000, help="rows each measure runs over")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only", nargs="+", choices=FEATURES, default=list(FEATURES), help="features to time"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    report: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "python": platform.python_version(),
        "rows": args.rows,
        "repeats": args.repeats,
        "unit": "microseconds per row (median_us, min_us, max_us over the repeats)",
    }
    work = Path(tempfile.mkdtemp(prefix="batchspec-bench-features-"))
    try:
        write_input(work, tickets(POOL, seed=10))
        if "templates" in args.only:
            report["templates"] = templates(work, args.rows, args.repeats)
        if "reasoning" in args.only:
            report["reasoning"] = reasoning(args.rows, args.repeats)
        if "structured" in args.only:
            report["structured"] = structured(args.rows, args.repeats)
        if "typed_answers" in args.only:
            report["typed_answers"] = typed_answers(work, args.rows, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
