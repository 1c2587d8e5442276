"""Images in rows on the real engine, with the tiny vision-language model `make models` builds
(``.models/vlm``, tools/tiny_vlm.py: it names the colours and the shape of a picture, so an image
that was dropped or swapped shows in its answer).

Each shape a row can carry its images in (a column of bytes, a column of storage URLs, several
image columns, a prompt template beside them, JSON-lines messages with ``image_url`` parts, an
OpenAI Batch request file) runs end to end and its text equals vLLM's own ``LLM.chat`` on the
same images and text (``image_url`` parts with ``data:`` URLs, parsed by vLLM). Every bad image
is its row's error while the rest generate, exit 0; a text-only target given images is exit 2
before any engine starts; n-gram speculation gives the same greedy text as off."""

from __future__ import annotations

import base64
import io
import json
import os
import random

import pyarrow as pa
import pytest
from helpers.emulators import azure_fs, azure_server, gcs_fs, gcs_server  # noqa: F401  (session fixtures)
from helpers.jobs import (
    MODELS,
    S3_SECRET,
    VLM_ENGINE,
    png_bytes,
    read_output,
    run_cli_in_process,
    write_job,
    write_parquet,
)
from tiny_vlm import HELD_OUT_SEED, QUESTIONS, picture  # tools/ is on the path (conftest.py)

from batchspec.spec.load import load_spec

VLM = MODELS / "vlm"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
#: The VLM with its draft: vLLM's drafter reads the target's image token from
#: ``image_token_index``, which Idefics3's config names ``image_token_id`` (docs/images.md).
DRAFTED = {**VLM_ENGINE, "hf_overrides": {"image_token_index": 2051}}
SAMPLING = {"temperature": 0.0, "max_tokens": 6}
ROWS = 12


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def pictures():
    """Held-out pictures (the build checked its accuracy on the same seed's), each with a question
    in turn of each kind and its right answer."""
    rng = random.Random(HELD_OUT_SEED + 1)
    kinds = sorted(QUESTIONS)
    out = []
    for i in range(ROWS):
        image, truth = picture(rng)
        kind = kinds[i % len(kinds)]
        out.append({"png": png_bytes(image), "question": QUESTIONS[kind][0], "answer": truth[kind]})
    return out


def job(root, name, input_keys, speculative=None, engine=VLM_ENGINE, **sections):
    return write_job(
        root / f"{name}.yaml",
        input={"id_column": "id", **input_keys} if input_keys.get("format") != "openai" else input_keys,
        output=sections.pop("output", {"path": str(root / f"out-{name}")}),
        model={"target": str(VLM), "engine": engine},
        speculative=speculative,
        sampling=SAMPLING,
        **sections,
    )


def run(shared_engines, path, **kwargs):
    result = shared_engines.run(load_spec(path), **kwargs)
    assert result.exit_code == 0, result.log
    return result


def texts(root, name) -> dict[str, dict]:
    return {r["id"]: r for r in read_output(root / f"out-{name}").to_pylist()}


@pytest.fixture(scope="module")
def bare(shared_engines, pictures):
    """vLLM's own ``LLM.chat`` on the job's engine, each picture as an ``image_url`` part holding
    a ``data:`` URL (parsed by vLLM itself): what every shape below must equal."""
    from vllm import SamplingParams

    engine = shared_engines.engine(SharedSpec.of())
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(p["png"])}},
                    {"type": "text", "text": p["question"]},
                ],
            }
        ]
        for p in pictures
    ]
    outputs = engine.llm.chat(conversations, SamplingParams(**SAMPLING), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


class SharedSpec:
    """The spec of the VLM's shared engine (speculation off), for the bare ``LLM.chat`` run."""

    @staticmethod
    def of(speculative=None):
        from helpers.shared_engines import SharedEngines

        return SharedEngines.probe_spec(VLM, VLM_ENGINE, speculative)


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory, pictures):
    root = tmp_path_factory.mktemp("images")
    pics = root / "pics"
    pics.mkdir()
    for i, p in enumerate(pictures):
        (pics / f"p{i}.png").write_bytes(p["png"])
    ids = [f"r{i}" for i in range(ROWS)]
    write_parquet(
        root / "in" / "rows.parquet",
        {
            "id": ids,
            "question": [p["question"] for p in pictures],
            "img": [p["png"] for p in pictures],
            "url": [str(pics / f"p{i}.png") for i in range(ROWS)],
        },
    )
    lines = [
        {
            "id": f"r{i}",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(p["png"])}},
                        {"type": "text", "text": p["question"]},
                    ],
                }
            ],
        }
        for i, p in enumerate(pictures)
    ]
    (root / "chat").mkdir()
    (root / "chat" / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": str(VLM),
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": f"file://{pics}/p{i}.png"}},
                            {"type": "text", "text": p["question"]},
                        ],
                    }
                ],
                "max_tokens": SAMPLING["max_tokens"],
            },
        }
        for i, p in enumerate(pictures)
    ]
    (root / "batch").mkdir()
    (root / "batch" / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in batch))
    return root


SHAPES = {
    "bytes": {"prompt_column": "question", "image_columns": ["img"]},
    "urls": {"prompt_column": "question", "image_columns": ["url"]},
    "template": {"prompt_template": "{{ question }}", "image_columns": ["img"]},
    "chat": {"messages_column": "messages"},
}


@pytest.mark.engine
def test_every_shape_of_image_row_equals_vllms_own_chat_and_the_image_decides_the_answer(
    shared_engines, image_rows, pictures, bare
):
    root = image_rows
    for name, keys in SHAPES.items():
        path = root / ("chat/*.jsonl" if name == "chat" else "in/*.parquet")
        roots = {"image_roots": [str(root / "pics")]} if name == "urls" else {}
        result = run(shared_engines, job(root, name, {"path": str(path), **keys, **roots}))
        assert result.summary["totals"]["images"] == ROWS  # the summary counts them
        out = texts(root, name)
        for i, want in enumerate(bare):
            row = out[f"r{i}"]
            assert row["error"] is None and row["generated_text"] == want, (name, i, row)
            # the picture's image token and the three Idefics3 puts around it are prompt tokens
            assert row["num_prompt_tokens"] >= 4 + 8, row
    from batchspec.report.metrics import build_report
    from batchspec.report.text import render_text

    report = build_report(str(root / "out-bytes"))
    assert report["images"] == {"images": ROWS, "rows": ROWS, "per_row": 1.0}
    assert "images" in render_text(report) and "1.0 a row" in render_text(report)
    right = sum(want.strip() == p["answer"] for want, p in zip(bare, pictures, strict=True))
    assert right >= 0.75 * ROWS, (bare, [p["answer"] for p in pictures])  # the image reached the model
    # OpenAI Batch files: the same texts, answered by custom_id, pictures read from storage URLs
    run(
        shared_engines,
        job(
            root,
            "batch",
            {
                "path": str(root / "batch" / "requests.jsonl"),
                "format": "openai",
                "image_roots": [str(root / "pics")],
            },
            output={"path": str(root / "out-batch"), "format": "openai"},
        ),
    )
    [results] = (root / "out-batch").glob("*.output.jsonl")
    answered = {}
    for line in results.read_text().splitlines():
        record = json.loads(line)
        answered[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    assert answered == {f"r{i}": want for i, want in enumerate(bare)}


@pytest.mark.engine
def test_two_images_a_row_and_a_swapped_image_change_the_answer(shared_engines, image_rows, pictures, bare):
    root = image_rows
    # the same question over another row's picture: the answer follows the picture
    swapped = list(reversed([p["png"] for p in pictures]))
    write_parquet(
        root / "swap" / "rows.parquet",
        {"id": [f"r{i}" for i in range(ROWS)], "question": [p["question"] for p in pictures], "img": swapped},
    )
    run(shared_engines, job(root, "swap", {"path": str(root / "swap" / "*.parquet"), **SHAPES["bytes"]}))
    out = texts(root, "swap")
    differ = sum(out[f"r{i}"]["generated_text"] != bare[i] for i in range(ROWS))
    assert differ >= ROWS // 3, (out, bare)
    # two image columns: both pictures reach the model, in column order (limit_mm_per_prompt 2)
    run(
        shared_engines,
        job(
            root,
            "two",
            {
                "path": str(root / "in" / "*.parquet"),
                "prompt_column": "question",
                "image_columns": ["img", "url"],
                "image_roots": [str(root / "pics")],
            },
        ),
    )
    two = texts(root, "two")
    one = texts(root, "bytes")
    assert all(two[k]["error"] is None for k in two), two
    assert all(two[k]["num_prompt_tokens"] == one[k]["num_prompt_tokens"] + 4 for k in two)
    # and the same texts as vLLM's own chat given both pictures in that order
    from vllm import SamplingParams

    engine = shared_engines.engine(SharedSpec.of())
    both = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(p["png"])}},
                    {"type": "image_url", "image_url": {"url": data_url(p["png"])}},
                    {"type": "text", "text": p["question"]},
                ],
            }
        ]
        for p in pictures
    ]
    outputs = engine.llm.chat(both, SamplingParams(**SAMPLING), use_tqdm=False)
    assert [two[f"r{i}"]["generated_text"] for i in range(ROWS)] == [o.outputs[0].text for o in outputs]


@pytest.mark.engine
def test_an_image_job_over_a_delta_table_reads_its_pinned_version(shared_engines, tmp_path, pictures, bare):
    """A Delta table with a binary image column: the run pins the version it reads (``input_pin.json``,
    docs/tables.md) and its texts equal vLLM's own chat."""
    import pyarrow as pa
    from deltalake import write_deltalake

    table = str(tmp_path / "table")
    rows = pa.table(
        {
            "id": [f"r{i}" for i in range(ROWS)],
            "question": [p["question"] for p in pictures],
            "img": pa.array([p["png"] for p in pictures], pa.binary()),
        }
    )
    write_deltalake(table, rows)
    path = job(tmp_path, "delta", {"path": table, "format": "delta", **SHAPES["bytes"]})
    run(shared_engines, path)
    out = texts(tmp_path, "delta")
    assert [out[f"r{i}"]["generated_text"] for i in range(ROWS)] == bare
    meta = json.loads((tmp_path / "out-delta" / "_batchspec" / "input_pin.json").read_text())
    assert meta.get("version") == 0, meta


@pytest.mark.engine
def test_every_bad_image_is_its_rows_error_and_the_rest_generate(shared_engines, tmp_path, pictures):
    from PIL import Image

    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "ok.png").write_bytes(pictures[0]["png"])
    (tmp_path / "outside.png").write_bytes(pictures[0]["png"])
    tiff = io.BytesIO()
    Image.new("RGB", (32, 32)).save(tiff, format="TIFF")
    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, format="PNG", optimize=True)
    big = png_bytes(Image.effect_noise((400, 400), 90).convert("RGB"))
    cases = {
        "good-bytes": (pictures[0]["png"], None),
        "corrupt": (pictures[0]["png"][:80], "corrupt image"),
        "format": (tiff.getvalue(), "corrupt, or not an image batchspec reads"),
        "bomb": (bomb.getvalue(), "image of 6000x6000 pixels is over input.max_image_pixels"),
        "big": (big, "is over input.max_image_bytes (100,000 bytes)"),
        "good-url": (str(pics / "ok.png"), None),
        "missing": (str(pics / "missing.png"), "image not found"),
        "http": ("http://127.0.0.1:9/cat.png", "never http://"),
        "outside": (str(tmp_path / "outside.png"), "is outside input.image_roots"),
        "link": (f"{pics}/../outside.png", "is outside input.image_roots"),
    }
    names = list(cases)
    write_parquet(
        tmp_path / "in" / "rows.parquet",
        {"id": names, "question": ["What shape is it?"] * len(names), "img": [cases[n][0] for n in names]},
        schema=pa.schema([("id", pa.string()), ("question", pa.string()), ("img", pa.binary())]),
    )
    # bytes and URLs in one column: the URL rows are written as their bytes of text
    write_parquet(
        tmp_path / "in2" / "rows.parquet",
        {
            "id": names,
            "question": ["What shape is it?"] * len(names),
            "img": [v if isinstance(v, str) else data_url(v) for v, _ in cases.values()],
        },
    )
    for folder in ("in", "in2"):
        path = job(
            tmp_path,
            folder,
            {
                "path": str(tmp_path / folder / "*.parquet"),
                "prompt_column": "question",
                "image_columns": ["img"],
                "image_roots": [str(pics)],
                "max_image_bytes": 100_000,
            },
        )
        result = run(shared_engines, path)
        out = texts(tmp_path, folder)
        for name, (value, error) in cases.items():
            if folder == "in" and isinstance(value, str):
                error = "corrupt, or not an image"  # a URL's text given as bytes
            row = out[name]
            if error is None:
                assert row["error"] is None and row["generated_text"], row
            else:
                assert (row["error"] or "").startswith("bad image: ") and error in row["error"], (name, row)
                assert row["finish_reason"] == "error"
        expected = sum(
            error is not None or (folder == "in" and isinstance(v, str)) for v, error in cases.values()
        )
        assert result.summary["totals"]["errors_by_reason"] == {"bad image": expected}
    # more image parts than the engine takes a prompt (limit_mm_per_prompt 2): refused unread
    part = {"type": "image_url", "image_url": {"url": data_url(pictures[0]["png"])}}
    text = {"type": "text", "text": "What shape is it?"}
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "rows.jsonl").write_text(
        "".join(
            json.dumps({"id": name, "m": [{"role": "user", "content": [*[part] * n, text]}]}) + "\n"
            for name, n in (("three", 3), ("one", 1))
        )
    )
    run(
        shared_engines,
        job(tmp_path, "chat", {"path": str(tmp_path / "chat" / "*.jsonl"), "messages_column": "m"}),
    )
    out = texts(tmp_path, "chat")
    assert (
        out["three"]["error"]
        == "bad image: 3 images, the engine takes 2 a prompt (model.engine.limit_mm_per_prompt.image)"
    )
    assert out["one"]["error"] is None and out["one"]["generated_text"]


@pytest.mark.engine
def test_ngram_speculation_on_image_rows_gives_the_greedy_text_of_off(shared_engines, image_rows, bare):
    root = image_rows
    run(
        shared_engines,
        job(root, "ngram", {"path": str(root / "in" / "*.parquet"), **SHAPES["bytes"]}, speculative=NGRAM),
    )
    out = texts(root, "ngram")
    assert [out[f"r{i}"]["generated_text"] for i in range(ROWS)] == bare
    assert all(r["spec_num_draft_tokens"] is not None for r in out.values())


@pytest.fixture(params=["s3", "gs", "az"])
def image_store(request, monkeypatch):
    """An object store on 127.0.0.1 (moto, gcp-storage-emulator, Azurite) as an image job sees
    it: (scheme, a client, the job's ``storage_options``, the environment it needs). S3's secret
    reaches the spec by ``${S3_SECRET}``."""
    scheme = request.param
    if scheme == "s3":
        import s3fs

        _, options = request.getfixturevalue("s3_server")
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        return scheme, fs, {**options, "secret": "${S3_SECRET}"}, {"S3_SECRET": S3_SECRET}
    emulator = request.getfixturevalue("gcs_server" if scheme == "gs" else "azure_server")
    for key, value in emulator.env.items():
        monkeypatch.setenv(key, value)
    fs = gcs_fs(emulator) if scheme == "gs" else azure_fs(emulator)
    return scheme, fs, dict(emulator.storage_options), dict(emulator.env)


@pytest.mark.engine
def test_image_urls_on_each_store_are_read_with_the_jobs_storage_options(
    shared_engines, tmp_path, pictures, bare, image_store
):
    """A column of s3://, gs:// or az:// URLs, read with the job's storage options: the same
    texts as the pictures' bytes; a missing one is its row's error, and a URL's signature never
    reaches it."""
    import uuid

    scheme, fs, options, env = image_store
    bucket = f"img-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    for i, p in enumerate(pictures):
        fs.pipe(f"{bucket}/pics/p{i}.png", p["png"])
    urls = [f"{scheme}://{bucket}/pics/p{i}.png" for i in range(ROWS)]
    urls[-1] = f"{scheme}://{bucket}/pics/missing.png?X-Amz-Signature={S3_SECRET}"
    write_parquet(
        tmp_path / "in" / "rows.parquet",
        {"id": [f"r{i}" for i in range(ROWS)], "question": [p["question"] for p in pictures], "url": urls},
    )
    path = job(
        tmp_path,
        scheme,
        {
            "path": str(tmp_path / "in" / "*.parquet"),
            "prompt_column": "question",
            "image_columns": ["url"],
            "image_roots": [f"{scheme}://{bucket}/pics"],
            "storage_options": options,
        },
    )
    result = shared_engines.run(load_spec(path, environ={**os.environ, **env}))
    assert result.exit_code == 0, result.log
    out = texts(tmp_path, scheme)
    assert [out[f"r{i}"]["generated_text"] for i in range(ROWS - 1)] == bare[:-1]
    missing = out[f"r{ROWS - 1}"]["error"]
    assert missing.startswith("bad image: image not found") and S3_SECRET not in missing, missing


def test_a_text_only_target_given_images_is_exit_2_before_any_engine(tmp_path, models):
    write_parquet(tmp_path / "in" / "rows.parquet", {"q": ["x"], "img": [b"\x89PNG"]})
    path = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "q", "image_columns": ["img"]},
        output={"path": str(tmp_path / "out")},
        model={"target": str(models / "target")},
        sampling={"temperature": 0.0},
    )
    for command in ("validate", "run"):
        result = run_cli_in_process(command, str(path))
        assert result.returncode == 2, result.stderr
        assert "input.image_columns" in result.stderr and "text-only" in result.stderr


@pytest.mark.engine
def test_a_draft_model_on_image_rows_gives_the_greedy_text_of_off(shared_engines, image_rows, bare):
    root = image_rows
    draft = {"method": "draft_model", "model": str(MODELS / "vlm-draft"), "num_speculative_tokens": 2}
    keys = {"path": str(root / "in" / "*.parquet"), **SHAPES["bytes"]}
    result = run(shared_engines, job(root, "draft", keys, speculative=draft, engine=DRAFTED))
    out = texts(root, "draft")
    assert [out[f"r{i}"]["generated_text"] for i in range(ROWS)] == bare
    assert all(r["spec_num_draft_tokens"] > 0 for r in out.values()), out
    assert result.summary["totals"]["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "speculative, engine, words",
    [
        ({"method": "eagle3", "model": str(MODELS / "head")}, DRAFTED, "takes no EAGLE-3 head"),
        (
            {"method": "draft_model", "model": str(MODELS / "vlm-draft")},
            VLM_ENGINE,
            "image_token_index: 2051",
        ),
    ],
)
def test_a_drafter_vllm_cannot_run_on_a_vision_language_target_is_exit_2(
    tmp_path, models, speculative, engine, words
):
    """Tried on vLLM 0.32's CPU build: an EAGLE-3 head on Idefics3 fails at start-up (``Target
    model does not have 'model' attribute``; its vLLM model has no EAGLE-3 interface), and a
    draft model without the target's ``image_token_index`` too (``'Idefics3Config' object has no
    attribute 'image_token_index'``): both are refused before any engine starts."""
    write_parquet(tmp_path / "in" / "rows.parquet", {"q": ["x"], "img": [b"\x89PNG"]})
    path = write_job(
        tmp_path / "job.yaml",
        input={"path": str(tmp_path / "in" / "*.parquet"), "prompt_column": "q", "image_columns": ["img"]},
        output={"path": str(tmp_path / "out")},
        model={"target": str(models / "vlm"), "engine": engine},
        speculative={**speculative, "num_speculative_tokens": 2},
        sampling={"temperature": 0.0},
    )
    result = run_cli_in_process("validate", str(path))
    assert result.returncode == 2, result.stderr
    assert "speculative.method" in result.stderr and words in result.stderr
    # chat messages with image_url parts: validate reads the rows and says which one
    line = {
        "m": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
            }
        ]
    }
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "rows.jsonl").write_text(json.dumps(line) + "\n")
    path = write_job(
        tmp_path / "chat.yaml",
        input={"path": str(tmp_path / "chat" / "*.jsonl"), "messages_column": "m"},
        output={"path": str(tmp_path / "out-chat")},
        model={"target": str(models / "target")},
        sampling={"temperature": 0.0},
    )
    result = run_cli_in_process("validate", str(path))
    assert result.returncode == 2, result.stderr
    assert "model.target" in result.stderr and "has images" in result.stderr and "text-only" in result.stderr
