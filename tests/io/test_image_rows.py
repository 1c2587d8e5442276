"""Images in rows, without an engine: reading a row's images from each input shape, the limits and
the locations an image may come from, and every bad image as that row's error (the engine tests
are tests/engine/test_images.py)."""

from __future__ import annotations

import base64
import io
import json
import time
import uuid

import pyarrow as pa
import pytest
from helpers.jobs import S3_SECRET, write_parquet

from batchspec.errors import InputDataError, SpecError
from batchspec.io.image_reader import read_image
from batchspec.io.images import ImageError, ImageLimits
from batchspec.io.listing import discover_shards
from batchspec.io.reader import open_reader
from batchspec.io.rows import asked_digest
from batchspec.spec.build import build_spec

#: Pillow, which decodes the images and draws these tests' pictures, comes with the engine extra
#: (pyproject.toml): `make test-py313`, batchspec without it, skips them (tests/conftest.py).
pytestmark = pytest.mark.vllm

LIMITS = ImageLimits(max_bytes=2**20, max_pixels=2**20)


def png(colour=(255, 0, 0), size=(32, 32), fmt="PNG") -> bytes:
    Image = pytest.importorskip("PIL.Image")

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb(side: int = 20_000) -> bytes:
    """A PNG of a few kB that decodes to side x side pixels (20,000: 400 M pixels, 1.2 GB as RGB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def spec_of(tmp_path, **input_keys):
    base = {"path": str(tmp_path / "in" / "*"), "prompt_column": "prompt"}
    return build_spec(
        {
            "input": {**base, **input_keys},
            "output": {"path": str(tmp_path / "out")},
            "model": {"target": "some/model"},
        }
    )


def rows_of(spec):
    [shard] = discover_shards(spec.input.paths, {}, input_format=spec.input.format)
    reader = open_reader(shard, spec)
    try:
        return list(reader.rows())
    finally:
        reader.close()


# ------------------------------------------------------------------ decoding and limits


def test_an_image_is_decoded_as_rgb_from_bytes_and_a_data_url():
    for ref in (png((0, 0, 255)), data_url(png((0, 0, 255))), png((0, 0, 255), fmt="JPEG")):
        image = read_image(ref, LIMITS)
        assert image.mode == "RGB" and image.size == (32, 32)
        r, g, b = image.getpixel((5, 5))
        assert b > 200 and r < 40 and g < 40


@pytest.mark.parametrize(
    "ref, words",
    [
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "corrupt, or not an image batchspec reads"),
        (png()[:60], "corrupt image"),
        (b"%PDF-1.4 not an image at all", "not an image batchspec reads \\(PNG"),
        (b"II*\x00" + b"\0" * 64, "not an image batchspec reads \\(PNG"),  # TIFF: not among the formats
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ],
)
def test_a_bad_image_is_refused_with_its_reason(ref, words):
    with pytest.raises(ImageError, match=words):
        read_image(ref, LIMITS)


def test_a_decompression_bomb_is_refused_from_its_header_unread():
    data = bomb()
    assert len(data) < 100_000
    started = time.monotonic()
    with pytest.raises(ImageError, match="decompression bomb"):  # Pillow's own limit, twice its warning's
        read_image(data, ImageLimits(max_bytes=2**20, max_pixels=2**25))
    with pytest.raises(ImageError, match=r"6000x6000 pixels is over input.max_image_pixels \(33,554,432\)"):
        read_image(bomb(6000), ImageLimits(max_bytes=2**20, max_pixels=2**25))
    assert time.monotonic() - started < 5  # decoding 400 M pixels would take far longer


def test_an_image_over_the_byte_limit_is_refused_before_it_is_decoded():
    data = png(size=(256, 256))
    small = ImageLimits(max_bytes=len(data) - 1, max_pixels=2**20)
    with pytest.raises(ImageError, match="over input.max_image_bytes"):
        read_image(data, small)
    with pytest.raises(ImageError, match="over input.max_image_bytes"):
        read_image(data_url(b"x" * 4096), ImageLimits(max_bytes=1024, max_pixels=2**20))


# ------------------------------------------------------------------ where an image may come from


@pytest.mark.parametrize(
    "url, scheme",
    [
        ("http://127.0.0.1:1/cat.png", "http://"),
        ("https://example.com/cat.png", "https://"),
        ("ftp://example.com/cat.png", "ftp://"),
        ("simplecache::s3://bucket/cat.png", "a chained URL"),
    ],
)
def test_a_url_of_a_scheme_batchspec_does_not_read_is_refused_unfetched(url, scheme):
    with pytest.raises(ImageError, match=f"never {scheme}"):
        read_image(url, ImageLimits(2**20, 2**20, roots=("/",)))


def test_a_local_image_is_read_only_under_image_roots_however_it_is_spelled(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png((0, 255, 0)))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    limits = ImageLimits(2**20, 2**20, roots=(str(root),))
    assert read_image(str(root / "a.png"), limits).size == (32, 32)
    assert read_image(f"file://{root}/a.png", limits).size == (32, 32)
    assert read_image(f"{root}//./a.png", limits).size == (32, 32)
    for outside in (
        str(tmp_path / "secret.png"),
        f"{root}/../secret.png",
        f"file://{root}/../secret.png",
        str(root / "link.png"),  # a link out of the root is judged by where it leads
        "/etc/passwd",
    ):
        with pytest.raises(ImageError, match="outside input.image_roots"):
            read_image(outside, limits)
    with pytest.raises(ImageError, match="input.image_roots names no location"):
        read_image(str(root / "a.png"), ImageLimits(2**20, 2**20))
    with pytest.raises(ImageError, match="image not found"):
        read_image(str(root / "missing.png"), limits)
    with pytest.raises(ImageError, match="cannot read image"):
        read_image(str(root), limits)


def test_an_image_on_s3_is_read_with_the_jobs_storage_options_and_its_url_shown_without_secrets(s3_server):
    import s3fs

    _, options = s3_server
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = f"img-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/pics/a.png", png((0, 255, 0)))
    limits = ImageLimits(2**20, 2**20, roots=(f"s3://{bucket}/pics",), storage_options=options)
    assert read_image(f"s3://{bucket}/pics/a.png", limits).getpixel((1, 1))[1] > 200
    with pytest.raises(ImageError) as info:
        read_image(f"s3://{bucket}/pics/missing.png?X-Amz-Signature={S3_SECRET}", limits)
    assert "image not found" in str(info.value) and S3_SECRET not in str(info.value)
    with pytest.raises(ImageError, match="outside input.image_roots"):
        read_image(f"s3://{bucket}/other/a.png", limits)


# ------------------------------------------------------------------ the spec


def test_image_keys_are_checked_before_any_work(tmp_path):
    spec = spec_of(tmp_path, image_columns="img", image_roots=[str(tmp_path / "pics")])
    assert spec.input.image_columns == ("img",) and spec.input.max_image_pixels == 2**25
    for keys, key, words in [
        ({"image_columns": ["a", "a"]}, "input.image_columns", "named twice"),
        ({"image_columns": [""]}, "input.image_columns", "non-empty"),
        ({"image_roots": ["https://example.com/pics"]}, "input.image_roots", "never https://"),
        ({"image_roots": ["data:image/png;base64,AA"]}, "input.image_roots", "no storage location"),
        ({"max_image_bytes": 0}, "input.max_image_bytes", "positive"),
    ]:
        with pytest.raises(SpecError) as info:
            spec_of(tmp_path, **keys)
        assert info.value.key == key and words in str(info.value), (keys, str(info.value))
    with pytest.raises(SpecError) as info:
        build_spec(
            {
                "input": {"path": "in/*.jsonl", "format": "openai", "image_columns": ["img"]},
                "output": {"path": "out"},
                "model": {"target": "m"},
            }
        )
    assert info.value.key == "input.image_columns"
    with pytest.raises(SpecError) as info:
        build_spec(
            {
                "task": "embed",
                "input": {"path": "in/*.parquet", "prompt_column": "p", "image_columns": ["img"]},
                "output": {"path": "out"},
                "model": {"target": "m"},
            }
        )
    assert info.value.key == "input.image_columns"


def test_image_roots_overlapping_the_output_are_refused(tmp_path):
    from batchspec.run.stages import plan

    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["x"], "img": [png()]})
    spec = spec_of(tmp_path, image_columns=["img"], image_roots=[str(tmp_path) + "//"])
    with pytest.raises(SpecError) as info:
        plan(spec)
    assert info.value.key == "input.image_roots" and "lies inside the image location" in str(info.value)


# ------------------------------------------------------------------ rows


def test_parquet_image_columns_become_image_parts_before_the_prompt_text(tmp_path):
    a, b = png((255, 0, 0)), png((0, 0, 255))
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {
            "prompt": ["What colour?", "same", "x", "same", "same"],
            "img": [a, b, None, a, a],
            "more": [["s3://b/x.png"], [data_url(b), str(tmp_path / "c.png")], ["u"], [], ["u"]],
            "note": ["k0", "k1", "k2", "k3", "k4"],
        },
    )
    rows = rows_of(spec_of(tmp_path, image_columns=["img", "more"]))
    first = rows[0]
    assert first.error is None and first.prompt is None and first.images == [a, "s3://b/x.png"]
    assert first.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": 0},
                {"type": "image", "image": 1},
                {"type": "text", "text": "What colour?"},
            ],
        }
    ]
    assert rows[1].images == [b, data_url(b), str(tmp_path / "c.png")]
    assert first.kept == {"note": "k0"}  # image columns are not copied to the output
    assert rows[2].error == "bad image: no image in column 'img'"
    assert rows[3].error == "bad image: no image in column 'more'"
    # the same text and the same image bytes: one request (twins); another image: another
    twin = rows_of(spec_of(tmp_path, image_columns=["img"]))
    assert asked_digest(twin[3]) == asked_digest(twin[4]) != asked_digest(twin[1])


def test_an_image_column_of_another_type_exits_3_naming_it(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["x"], "img": [3]})
    with pytest.raises(InputDataError) as info:
        rows_of(spec_of(tmp_path, image_columns=["img"]))
    assert "image column 'img' has type int64" in str(info.value)
    write_parquet(tmp_path / "in" / "a.parquet", {"prompt": ["x"]})
    with pytest.raises(InputDataError, match="missing image column 'img'"):
        rows_of(spec_of(tmp_path, image_columns=["img"]))


def test_image_columns_go_into_the_first_user_message_of_a_messages_template(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"q": ["Shape?"], "img": [png()]})
    spec = spec_of(
        tmp_path,
        prompt_column=None,
        messages_template=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "{{ q }}"},
        ],
        image_columns=["img"],
    )
    [row] = rows_of(spec)
    assert row.error is None
    assert row.messages[0] == {"role": "system", "content": "Be brief."}
    assert row.messages[1]["content"] == [{"type": "image", "image": 0}, {"type": "text", "text": "Shape?"}]


def test_json_lines_messages_with_image_url_parts(tmp_path):
    url = data_url(png())
    lines = [
        {
            "m": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Hi"},
                    ],
                }
            ]
        },
        {"m": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        {"m": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
        {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}]},
        {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": [[url]]}}]}]},
        {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3000}]},
    ]
    path = tmp_path / "in" / "a.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = rows_of(spec_of(tmp_path, prompt_column=None, messages_column="m"))
    assert rows[0].error is None and rows[0].images == [url]
    assert rows[0].messages[0]["content"] == [{"type": "image", "image": 0}, {"type": "text", "text": "Hi"}]
    assert rows[1].messages[0]["content"] == "ab" and rows[1].images is None
    assert rows[2].error == (
        "bad image: messages[0].content[0] is a part of type 'input_audio': batchspec reads text "
        "and image_url parts: line 3"
    )
    assert rows[3].error is None  # an image alone is content enough
    assert rows[4].error == "bad image: messages[0].content[0] has no image_url.url: line 5"
    assert rows[5].error == "bad image: messages[0].content[0] has no image_url.url: line 6"
    assert rows[6].error is None and len(rows[6].images) == 3000  # the engine's limit refuses it


def test_parquet_messages_with_image_url_parts(tmp_path):
    part = pa.struct(
        [("type", pa.string()), ("text", pa.string()), ("image_url", pa.struct([("url", pa.string())]))]
    )
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    url = str(tmp_path / "pics" / "a.png")
    write_parquet(
        tmp_path / "in" / "a.parquet",
        {
            "m": [
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": "Q"},
                        ],
                    }
                ]
            ]
        },
        schema=pa.schema([("m", pa.list_(message))]),
    )
    [row] = rows_of(spec_of(tmp_path, prompt_column=None, messages_column="m"))
    assert row.error is None and row.images == [url]
    assert row.messages[0]["content"] == [{"type": "image", "image": 0}, {"type": "text", "text": "Q"}]


def test_openai_batch_lines_with_image_url_parts(tmp_path):
    url = data_url(png())
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "some/model",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Colour?"},
                        {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                    ],
                }
            ],
        },
    }
    path = tmp_path / "in" / "a.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(line) + "\n")
    spec = build_spec(
        {
            "input": {"path": str(path), "format": "openai"},
            "output": {"path": str(tmp_path / "out")},
            "model": {"target": "some/model"},
        }
    )
    [row] = rows_of(spec)
    assert row.error is None and row.request_id == "c1" and row.images == [url]
    assert row.messages[0]["content"] == [{"type": "text", "text": "Colour?"}, {"type": "image", "image": 0}]


def test_secrets_in_an_image_url_are_never_in_a_rows_error(tmp_path):
    url = f"s3://user:{S3_SECRET}@bucket/a.png?token={S3_SECRET}"
    with pytest.raises(ImageError) as info:
        read_image(url, ImageLimits(2**20, 2**20))
    assert S3_SECRET not in str(info.value) and "s3://bucket/a.png" in str(info.value)


def test_distill_refuses_a_job_whose_rows_carry_images(tmp_path):
    """A drafter trains on token ids: it would never see the images, so distill refuses the job
    before any work (n-gram needs no training)."""
    from batchspec.distill.options import DistillOptions
    from batchspec.distill.session import check_options

    spec = spec_of(tmp_path, image_columns=["img"])
    with pytest.raises(SpecError) as info:
        check_options(spec, DistillOptions(out=tmp_path / "d", method="eagle3"))
    assert info.value.key == "input.image_columns" and "trains drafters on text" in str(info.value)


def test_a_store_that_fails_half_its_requests_still_gives_the_image_and_one_that_never_answers_fails_the_run(
    monkeypatch,
):
    """A transient store error is retried under the storage policy; once the attempts are spent
    it is the run's failure (exit 1, the row unwritten, a rerun reads it again), never a row
    error that a rerun would keep."""
    import errno

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from batchspec.errors import RuntimeFailure
    from batchspec.io import retry

    monkeypatch.setattr(retry, "ATTEMPTS", 3)
    monkeypatch.setattr(retry, "BACKOFF_S", 0.01)
    fs = fsspec.filesystem("memory")
    fs.pipe("/flaky/pics/a.png", png((0, 255, 0)))
    opened = MemoryFileSystem.open
    calls = {"n": 0, "fail": "half"}

    def flaky(self, path, *args, **kwargs):
        calls["n"] += 1
        if calls["fail"] == "always" or calls["n"] % 2:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return opened(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "open", flaky)
    limits = ImageLimits(2**20, 2**20, roots=("memory://flaky/pics",))
    for _ in range(3):
        assert read_image("memory://flaky/pics/a.png", limits).getpixel((1, 1))[1] > 200
    calls["fail"] = "always"
    with pytest.raises(RuntimeFailure, match="reading image"):
        read_image("memory://flaky/pics/a.png", limits)
