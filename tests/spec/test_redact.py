"""Secrets never leave the process: URLs, free text, the public view of the spec, and a whole run
whose summary, manifest and Parquet metadata must not hold any credential of its spec."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers.fakes import FakeEngine
from helpers.jobs import write_parquet

from batchspec.io.writer import read_metadata
from batchspec.redact import (
    REDACTED,
    is_secret_key,
    public_spec,
    sanitize_url,
    scrub_text,
    secret_values,
)
from batchspec.run.events import EventLog
from batchspec.run.job import RunOptions, run_job
from batchspec.spec.build import build_spec

# ----------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url, expected",
    [
        # userinfo, on every kind of store
        ("s3://AKIAKEY:s3cr3t@bucket/in/*.parquet", "s3://bucket/in/*.parquet"),
        ("gs://user:pw12@bucket/a/b.parquet", "gs://bucket/a/b.parquet"),
        ("https://user:password@host.example:8443/p/x.parquet", "https://host.example:8443/p/x.parquet"),
        ("https://ghp_tokenvalue@host.example/o/r", "https://host.example/o/r"),
        ("abfs://user:key1@account.dfs.core.windows.net/c/x", "abfs://account.dfs.core.windows.net/c/x"),
        # a password with '@' or a raw '/' (AWS secret keys hold '/') goes whole
        ("https://u:p@ss@host.example/x", "https://host.example/x"),
        ("s3://AKIAKEY:abc/def+ghi@bucket/key.parquet", "s3://bucket/key.parquet"),
        # presigned query strings and fragments
        (
            "https://b.s3.amazonaws.com/in/x.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=abc123",
            "https://b.s3.amazonaws.com/in/x.parquet",
        ),
        ("https://host.example/x.parquet#access_token=zzz", "https://host.example/x.parquet"),
        ("https://host.example/x.parquet?token", "https://host.example/x.parquet"),
        ("az://container/x.parquet?sv=2022-11-02&sig=c2lnbmF0dXJl", "az://container/x.parquet"),
        ("s3://bucket/key.parquet?versionId=7", "s3://bucket/key.parquet"),
        # chained fsspec URLs and a doubled scheme
        ("simplecache::s3://AKIAKEY:s3cr3t@bucket/x", "simplecache::s3://bucket/x"),
        ("http://http://user:pw99@127.0.0.1:9/x?X-Amz-Signature=z", "http://http://127.0.0.1:9/x"),
        # left alone: globs ('?' is a wildcard), Azure's container@account, ports, '@' in a path
        ("s3://bucket/part-?.parquet", "s3://bucket/part-?.parquet"),
        ("gs://bucket/data/[ab]*/x?.parquet", "gs://bucket/data/[ab]*/x?.parquet"),
        (
            "abfs://container@account.dfs.core.windows.net/x",
            "abfs://container@account.dfs.core.windows.net/x",
        ),
        ("http://host.example:8080/data@v2/x", "http://host.example:8080/data@v2/x"),
        ("gs://bucket/user@example.com/x", "gs://bucket/user@example.com/x"),
        # plain local paths: unchanged, whatever they hold
        ("data/prompts/*.parquet", "data/prompts/*.parquet"),
        ("/tmp/a@b/x?y=1.parquet", "/tmp/a@b/x?y=1.parquet"),
        ("file:///tmp/x.parquet", "file:///tmp/x.parquet"),
    ],
)
def test_sanitize_url(url, expected):
    assert sanitize_url(url) == expected


def test_scrub_text_masks_given_secrets_and_every_url():
    text = (
        "storage failed: could not open https://user:hunter2-pass@h.example/x.parquet?"
        "X-Amz-Signature=feedface (Authorization: Bearer tok-abcdef) and 'gs://k:v@b/y'"
    )
    out = scrub_text(text, ["Bearer tok-abcdef", "abc"])
    assert out == (
        "storage failed: could not open https://h.example/x.parquet (Authorization: ***) and 'gs://b/y'"
    )
    # values shorter than 4 characters would garble words: left alone
    assert scrub_text("abc abcd", ["abc", "abcd"]) == "abc ***"
    # a longer secret that contains a shorter one is replaced whole
    assert scrub_text("key=secretvalue", ["secret", "secretvalue"]) == "key=***"
    assert scrub_text("", ["x"]) == ""


def test_scrub_text_is_quick_enough_for_every_log_line():
    secrets = [f"secret-value-{i:03d}" for i in range(50)]
    lines = [
        f"shard s{i} committed: 1024 rows, 0 errors, s3://bucket/out/s{i}.parquet, "
        f"acceptance 0.73 and {secrets[i % 50] if i % 10 == 0 else 'nothing secret'}"
        for i in range(5000)
    ]
    start = time.perf_counter()
    out = [scrub_text(line, secrets) for line in lines]
    elapsed = time.perf_counter() - start
    assert not any("secret-value" in line for line in out)
    assert elapsed < 2.0, f"{elapsed:.2f}s for 5000 lines"


@pytest.mark.parametrize(
    "key",
    [
        "token",
        "hf_token",
        "api_key",
        "x-api-key",
        "Authorization",
        "password",
        "passphrase",
        "client_secret",
        "aws_access_key_id",
        "sas_token",
        "sasToken",
        "accountKey",
        "connection_string",
        "private_key",
        "credentials",
        "sig",
        "X-Amz-Security-Token",
    ],
)
def test_credential_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "max_tokens",
        "num_speculative_tokens",
        "skip_special_tokens",
        "eos_token",
        "tokenizer",
        "tokenizer_revision",
        "endpoint_url",
        "keep_columns",
        "id_column",
        "seed",
        "prompt_lookup_max",
        "dtype",
    ],
)
def test_ordinary_keys(key):
    assert not is_secret_key(key)


# ----------------------------------------------------------------------------------- the spec

RAW = {
    "name": "secrets",
    "input": {
        "path": [
            "https://u:hunter2-pass@h.example/in/a.parquet?X-Amz-Signature=feedface0123",
            "data/local/*.parquet",
        ],
        "prompt_column": "prompt",
        "storage_options": {
            "headers": {"Authorization": "Bearer tok-abcdef"},
            "client_kwargs": {"endpoint_url": "http://minio:pw-minio@m.example:9000"},
            "passphrase": "open-sesame",
            "block_size": 1024,
            "anon": False,
            "list_opt": ["a-value", {"deep": "deep-value"}],
        },
    },
    "output": {"path": "s3://AKIAOUT:out-secret/x@bucket/out/", "storage_options": {"key": "AKIAOUT"}},
    "model": {
        "target": "org/model",
        "engine": {
            "max_model_len": 512,
            "dtype": "float32",
            "enforce_eager": True,
            "seed": None,
            "hf_token": "hf_abcdefghijkl",
            "tokenizer": "https://t:tokpw@hub.example/tok?sig=xyz",
            "mystery_arg": "could-be-anything",
            "hf_overrides": {"architectures": ["LlamaForCausalLM"], "api_key": "nested-key-1"},
        },
    },
    "speculative": {
        "method": "draft_model",
        "model": "s3://d:dpass@bucket/draft",
        "num_speculative_tokens": 4,
    },
    "sampling": {"temperature": 0.0, "max_tokens": 8, "stop": ["</s>"]},
}


def test_public_spec_rules():
    before = json.dumps(RAW, sort_keys=True)
    out = public_spec(RAW)
    assert json.dumps(RAW, sort_keys=True) == before  # the original is untouched
    so = out["input"]["storage_options"]
    # every value under storage_options, keys kept, nested too
    assert so == {
        "headers": {"Authorization": REDACTED},
        "client_kwargs": {"endpoint_url": REDACTED},
        "passphrase": REDACTED,
        "block_size": REDACTED,
        "anon": REDACTED,
        "list_opt": [REDACTED, {"deep": REDACTED}],
    }
    assert out["output"]["storage_options"] == {"key": REDACTED}
    # URLs lose userinfo and query strings; local paths stay
    assert out["input"]["path"] == ["https://h.example/in/a.parquet", "data/local/*.parquet"]
    assert out["output"]["path"] == "s3://bucket/out/"
    assert out["speculative"] == {
        "method": "draft_model",
        "model": "s3://bucket/draft",
        "num_speculative_tokens": 4,
    }
    # engine: numbers, booleans, null and allow-listed strings kept; credentials and unknown
    # strings hidden; nested credential keys hidden
    engine = out["model"]["engine"]
    assert engine == {
        "max_model_len": 512,
        "dtype": "float32",
        "enforce_eager": True,
        "seed": None,
        "hf_token": REDACTED,
        "tokenizer": "https://hub.example/tok",
        "mystery_arg": REDACTED,
        "hf_overrides": {"architectures": ["LlamaForCausalLM"], "api_key": REDACTED},
    }
    assert out["sampling"] == RAW["sampling"] and out["name"] == "secrets"
    text = json.dumps(out)
    for secret in secret_values(RAW):
        assert secret not in text or len(secret) < 4, secret


def test_secret_values_lets_scrub_text_clean_messages():
    secrets = secret_values(RAW)
    for value in (
        "Bearer tok-abcdef",
        "open-sesame",
        "hf_abcdefghijkl",
        "hunter2-pass",
        "feedface0123",
        "AKIAOUT",
        "out-secret/x",
        "dpass",
        "nested-key-1",
        "could-be-anything",
        "deep-value",
        "pw-minio",
    ):
        assert value in secrets, value
    assert "float32" not in secrets and "org/model" not in secrets
    message = (
        "botocore: The AWS Access Key Id AKIAOUT does not exist; header 'Bearer tok-abcdef'; "
        "passphrase open-sesame rejected"
    )
    cleaned = scrub_text(message, secrets)
    assert cleaned == (
        "botocore: The AWS Access Key Id *** does not exist; header '***'; passphrase *** rejected"
    )


def test_jobspec_public_view_and_secret_values(tmp_path):
    spec = build_spec(RAW)
    assert spec.public() == public_spec(RAW)
    assert spec.secret_values() == secret_values(RAW)


# ----------------------------------------------------------------------------------- a whole run


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with HTTP Range support (fsspec reads Parquet footers by range)."""

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(data) - 1
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):  # noqa: N802
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


@pytest.fixture
def http_root(tmp_path):
    """A real HTTP server on 127.0.0.1 serving ``tmp_path/www``: yields (root dir, base URL)."""
    root = tmp_path / "www"
    root.mkdir()

    def handler(*args, **kwargs):
        return _RangeHandler(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SECRETS = {
    "authorization": "Bearer authz-4f1c9e2d",
    "passphrase": "pass-phrase-77aa1b",
    "hf_token": "hf_tok_9b8c7d6e5f",
    "password": "url-pw-31337x",
    "signature": "sig0123456789abcdef",
}


def _run_and_read(spec, out_dir: Path) -> dict[str, str]:
    """Run ``spec`` with the fake engine; the text of everything the run persisted."""
    log = EventLog("test", "json")
    log.emit = lambda *a, **f: None
    result = run_job(spec, RunOptions(engine=FakeEngine(), events=log, progress_bars=False))
    assert result.summary["status"] == "ok" and result.summary["totals"]["rows"] == 5
    outputs = sorted(out_dir.rglob("*.parquet"))
    assert len(outputs) == 1 and pq.read_table(outputs[0]).num_rows == 5
    persisted = {
        "run summary": (out_dir / "_batchspec" / "runs" / f"{result.run_id}.json").read_text(),
        "manifest": "".join(
            p.read_text() for p in (out_dir / "_batchspec" / "manifest").rglob("*") if p.is_file()
        ),
        "parquet metadata": json.dumps(read_metadata(str(outputs[0]))),
        "parquet file": outputs[0].read_bytes().decode("latin-1"),
        "file names": "\n".join(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")),
    }
    assert persisted["manifest"], "no manifest written"
    assert "spec" in read_metadata(str(outputs[0]))
    return persisted


def _assert_clean(persisted: dict[str, str]) -> None:
    for where, text in persisted.items():
        for name, secret in SECRETS.items():
            assert secret not in text, f"the {name} is in the {where}"
        assert "reader:" not in text, f"URL userinfo in the {where}"
        assert "X-Amz-Signature" not in text, f"a presigned query in the {where}"


@pytest.mark.vllm
def test_run_persists_no_secret_of_its_spec(tmp_path, http_root):
    root, host = http_root
    write_parquet(root / "in" / "s0.parquet", {"prompt": [f"p{i}" for i in range(5)], "k": list(range(5))})
    presigned = (
        f"https://reader:{SECRETS['password']}@hub.example/tok"
        f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRETS['signature']}"
    )
    out_dir = tmp_path / "out"
    spec = build_spec(
        {
            "name": "leak-check",
            "input": {
                "path": f"http://{host}/in/s0.parquet",
                "prompt_column": "prompt",
                "storage_options": {"headers": {"Authorization": SECRETS["authorization"]}},
            },
            "output": {"path": str(out_dir), "storage_options": {"passphrase": SECRETS["passphrase"]}},
            # the fake engine loads nothing: the engine arguments only travel into what is persisted
            "model": {
                "target": "unused",
                "engine": {"hf_token": SECRETS["hf_token"], "tokenizer": presigned},
            },
            "sampling": {"temperature": 0.0, "max_tokens": 8},
        }
    )
    persisted = _run_and_read(spec, out_dir)
    _assert_clean(persisted)
    # the public spec still says what was used, without the credentials
    summary = json.loads(persisted["run summary"])
    assert summary["spec"]["input"]["path"] == f"http://{host}/in/s0.parquet"
    assert summary["spec"]["model"]["engine"] == {
        "hf_token": REDACTED,
        "tokenizer": "https://hub.example/tok",
    }
    assert summary["spec"]["input"]["storage_options"] == {"headers": {"Authorization": REDACTED}}


@pytest.mark.vllm
def test_run_from_a_presigned_input_url_persists_no_secret(tmp_path, http_root):
    root, host = http_root
    write_parquet(root / "in" / "s0.parquet", {"prompt": [f"p{i}" for i in range(5)], "k": list(range(5))})
    presigned = (
        f"http://reader:{SECRETS['password']}@{host}/in/s0.parquet"
        f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRETS['signature']}"
    )
    out_dir = tmp_path / "out"
    spec = build_spec(
        {
            "name": "leak-check",
            # aiohttp refuses an Authorization header beside URL credentials: the header goes with
            # the output (fsspec's local filesystem takes and ignores unknown options)
            "input": {"path": presigned, "prompt_column": "prompt"},
            "output": {
                "path": str(out_dir),
                "storage_options": {
                    "passphrase": SECRETS["passphrase"],
                    "headers": {"Authorization": SECRETS["authorization"]},
                },
            },
            "model": {"target": "unused", "engine": {"hf_token": SECRETS["hf_token"]}},
            "sampling": {"temperature": 0.0, "max_tokens": 8},
        }
    )
    _assert_clean(_run_and_read(spec, out_dir))


def test_public_spec_of_every_shape_is_json():
    raw = {
        "a": {"when": __import__("datetime").date(2026, 1, 2), "blob": b"\x00secret", "set": {1, 2}},
        "t": (1, 2),
    }
    out = public_spec(raw)
    assert out == {"a": {"when": "2026-01-02", "blob": REDACTED, "set": [1, 2]}, "t": [1, 2]}
    json.dumps(out)


# ----------------------------------------------------------------------------------- written specs
# What `tune --write` may write: credentials only as ${VAR} (imported in the tests, so that the
# module's other tests still run where these helpers are missing).


@pytest.mark.parametrize(
    "value, reference",
    [
        ("${HF_TOKEN}", True),
        ("${HF_TOKEN:-}", True),
        ("Bearer ${TOKEN}", True),
        ("${USER_A}${USER_B}", True),
        ("${HF_TOKEN:-hf_default}", False),
        ("hf_abc", False),
        ("abc${X}", False),
        ("${X} tail", False),
        ("", False),
        (1234, False),
    ],
)
def test_env_reference(value, reference):
    from batchspec.redact import is_env_reference

    assert is_env_reference(value) is reference


def test_literal_secrets_names_every_credential_written_literally():
    from batchspec.redact import literal_secrets

    raw = {
        "input": {
            "path": "s3://bucket/in/*.parquet",
            "storage_options": {
                "key": "AKIAEXAMPLE",
                "secret": "${AWS_SECRET}",
                "endpoint_url": "http://127.0.0.1:9000",
                "anon": False,
                "client_kwargs": {"aws_session_token": "FQoGZX"},
            },
        },
        "output": {"path": "s3://AKIA:pw99@bucket/out", "storage_options": {"token": "anon", "project": "p"}},
        "model": {
            "target": "https://tok9876@host.example/m",
            "engine": {"hf_token": 12345678, "max_num_seqs": 4},
        },
        "speculative": {"model": "https://host.example/d?sv=2024&sig=abc%2Bdef", "num_speculative_tokens": 4},
        "sampling": {"max_tokens": 8, "stop": ["${STOP}"]},
        "executor": {
            "ray": {"runtime_env": {"env_vars": {"HF_TOKEN": "${HF_TOKEN}", "API_KEY": "${API_KEY:-k-123}"}}}
        },
    }
    assert literal_secrets(raw) == [
        "input.storage_options.key",
        "input.storage_options.client_kwargs.aws_session_token",
        "output.path (the password in the URL's user:password@)",
        "model.target (the token in the URL's token@)",
        "model.engine.hf_token",
        "speculative.model (the URL's query parameter sig=)",
        "executor.ray.runtime_env.env_vars.API_KEY",
    ]


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/in/*.parquet",
        "s3://bucket/x.parquet?versionId=3",
        "sftp://me@host/data",
        "az://container@account.dfs.core.windows.net/x",
        "https://${USER}:${PW}@host/x?sig=${SIG}",
        "https://host.example/x?token=${TOKEN}",
        "gs://bucket/part-?.parquet",
        "data/local.parquet",
    ],
)
def test_urls_without_a_literal_credential(url):
    from batchspec.redact import literal_secrets, url_literal_secrets

    assert url_literal_secrets(url) == [] and literal_secrets({"input": {"path": url}}) == []


@pytest.mark.parametrize(
    "url, what",
    [
        ("https://u:p4ss@host/x", "the password in the URL's user:password@"),
        ("s3://AKIA:se/cr/et@bucket/x", "the password in the URL's user:password@"),
        ("https://ghp_token@host/x", "the token in the URL's token@"),
        (
            "https://host/x?X-Amz-Credential=AKIA%2F2024&X-Amz-Signature=ab12",
            "the URL's query parameter X-Amz-Credential=",
        ),
        ("abfs://c@acct.dfs.core.windows.net/x?sp=r&sig=ab%3D", "the URL's query parameter sig="),
        ("https://host/x?access_token=ya29", "the URL's query parameter access_token="),
    ],
)
def test_urls_with_a_literal_credential(url, what):
    from batchspec.redact import url_literal_secrets

    assert what in url_literal_secrets(url)
