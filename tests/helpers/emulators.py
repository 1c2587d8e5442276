"""Cloud storage emulators for the gs:// and az:// tests, each on 127.0.0.1 on a free port, started
once per session and stopped at its end.

- ``gs://``: gcp-storage-emulator (a Python package in the ``dev`` extra), served from a thread of
  the test process, as moto is for ``s3://``. gcsfs talks to it with ``endpoint_url`` and
  ``token: anon``. ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` must be in the environment before
  gcsfs is imported: otherwise gcsfs probes each bucket's type over gRPC first and waits 60 s per
  call against an emulator.
- ``az://``: Azurite (the npm package, installed into ``.azurite/`` by ``make emulators``), run by
  node. adlfs connects with the emulator's published development connection string. Without
  node the Azure tests skip, saying so.

The GCS emulator as shipped ignores ``ifGenerationMatch`` (it never answers 412), so batchspec's
probe finds no conditional writes there and its leases fall back to best effort, with a warning.
:func:`gcs_cas_server` serves a second emulator to which :func:`_honour_preconditions` adds GCS's
documented precondition rules, so that the compare-and-swap adapter is tested over HTTP too.
"""

from __future__ import annotations

import http
import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.jobs import ROOT, free_port

#: What gcsfs needs in the environment against an emulator (see the module docstring).
GCSFS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
os.environ.update(GCSFS_ENV)  # before anything imports gcsfs, in this process and its children

#: Where ``make emulators`` installs Azurite (git-ignored).
AZURITE_PREFIX = ROOT / ".azurite"
AZURE_ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development account key, published in its documentation: not a secret,
#: but the tests still check that it never reaches outputs or logs, as a real key must not.
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class Emulator:
    """A running emulator: where it listens and what a job's ``storage_options`` need."""

    endpoint: str
    storage_options: dict
    #: Environment a ``batchspec`` process needs to reach it (besides ``storage_options``).
    env: dict = field(default_factory=dict)


def _require(module: str) -> None:
    """Fail (not skip) when a client library of the ``dev`` extra is missing: CI must run these."""
    try:
        __import__(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not installed ({exc}): run `make setup`")


def _wait_for_port(url: str, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 60) -> None:
    """Wait until ``url`` answers an HTTP request (any status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it listened on {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                reply.read()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {url} within {timeout_s:.0f}s")


# ---------------------------------------------------------------------- GCS


def _honour_preconditions() -> None:
    """Teach gcp-storage-emulator's object routes ``ifGenerationMatch`` (on uploads, metadata and
    media reads, deletes) and the ``x-goog-generation`` header on media reads, as GCS documents
    them, for the emulators whose storage has ``honour_preconditions`` set. Its HTTP server
    answers one request at a time, so the check and the write cannot interleave. Idempotent."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound

    def current_generation(request, storage, object_id: str | None) -> str:
        try:
            return str(storage.get_file_obj(request.params["bucket_name"], object_id)["generation"])
        except (NotFound, KeyError, TypeError):
            return "0"  # GCS: generation 0 matches "no live object"

    def object_id_of(request) -> str | None:
        if "object_id" in (request.params or {}):
            return request.params["object_id"]
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data  # a multipart upload names its object in the JSON part
        return data.get("meta", {}).get("name") if isinstance(data, dict) else None

    def guarded(handler):
        if getattr(handler, "_batchspec_guarded", False):
            return handler

        def call(request, response, storage, *args, **kwargs):
            if not getattr(storage, "honour_preconditions", False):
                return handler(request, response, storage, *args, **kwargs)
            object_id = object_id_of(request)
            want = request.query.get("ifGenerationMatch")
            if want and current_generation(request, storage, object_id) != want[0]:
                response.status = http.HTTPStatus.PRECONDITION_FAILED
                response.json(
                    {
                        "error": {
                            "code": 412,
                            "errors": [{"reason": "conditionNotMet"}],
                            "message": "At least one of the pre-conditions you specified did not hold.",
                        }
                    }
                )
                return None
            result = handler(request, response, storage, *args, **kwargs)
            if request.method == "GET" and response.status == http.HTTPStatus.OK:
                response["x-goog-generation"] = current_generation(request, storage, object_id)
            return result

        call._batchspec_guarded = True
        return call

    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if getattr(handler, "__module__", "").endswith("handlers.objects") and handler.__name__ in (
                "insert",
                "get",
                "delete",
                "download",
            ):
                handlers[method] = guarded(handler)


def _gcs_emulator(honour_preconditions: bool):
    """Start gcp-storage-emulator in memory on a free port; yields an :class:`Emulator`."""
    _require("gcsfs")
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    if honour_preconditions:
        _honour_preconditions()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server._storage.honour_preconditions = honour_preconditions
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    _wait_for_port(endpoint + "/", "gcp-storage-emulator")
    try:
        yield Emulator(
            endpoint, {"endpoint_url": endpoint, "token": "anon", "project": "test"}, dict(GCSFS_ENV)
        )
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    """gcp-storage-emulator as shipped (no conditional writes)."""
    yield from _gcs_emulator(honour_preconditions=False)


@pytest.fixture(scope="session")
def gcs_cas_server():
    """gcp-storage-emulator with GCS's ``ifGenerationMatch`` rules (see the module docstring)."""
    yield from _gcs_emulator(honour_preconditions=True)


def gcs_fs(emulator: Emulator):
    """A fresh gcsfs filesystem on the emulator (no instance cache: tests see their own writes)."""
    import gcsfs

    return gcsfs.GCSFileSystem(**emulator.storage_options, skip_instance_cache=True)


# ---------------------------------------------------------------------- Azure


def azurite_command() -> list[str]:
    """The command that starts Azurite's blob service; skips the test if node is missing."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the az:// tests need Azurite (npm), which runs on node")
    installed = AZURITE_PREFIX / "node_modules" / ".bin" / "azurite-blob"
    if installed.exists():
        return [str(installed)]
    on_path = shutil.which("azurite-blob")
    if on_path:
        return [on_path]
    pytest.fail(f"Azurite is not installed in {AZURITE_PREFIX}: run `make emulators`")


def azure_connection_string(endpoint: str) -> str:
    """The development account's connection string for an Azurite blob endpoint."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURE_ACCOUNT};"
    )


def _azurite():
    """Start Azurite's blob service in memory on a free port; yields an :class:`Emulator` whose
    ``storage_options`` hold the connection string."""
    _require("adlfs")
    command = azurite_command()
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="batchspec-azurite-")
    log_path = Path(workdir) / "azurite.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [
                *command,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--silent",
                "--disableTelemetry",
                "--skipApiVersionCheck",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait_for_port(endpoint + f"/{AZURE_ACCOUNT}?comp=list", "Azurite", proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its log: {log_path.read_text(errors='replace')[-2000:]}") from None
        yield Emulator(endpoint, {"connection_string": azure_connection_string(endpoint)})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def azure_server():
    """Azurite's blob service (see :func:`_azurite`)."""
    yield from _azurite()


def azure_fs(emulator: Emulator):
    """A fresh adlfs filesystem on Azurite."""
    import adlfs

    return adlfs.AzureBlobFileSystem(**emulator.storage_options, skip_instance_cache=True)
