"""tools/model_cache.py: `make models` builds each tiny model once per content.

The builds here are small Python commands that write a folder and count their runs, so each test
sees whether a build ran or was restored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.jobs import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import model_cache  # noqa: E402

BUILD = """
import pathlib, sys
if pathlib.Path(sys.argv[3]).read_text() == "fail":
    sys.exit(3)
out = pathlib.Path(sys.argv[1]) / sys.argv[2]
out.mkdir(parents=True, exist_ok=True)
(out / "weights.bin").write_bytes(pathlib.Path(sys.argv[3]).read_bytes() * 3)
(out / ".batchspec-complete").write_text("ok")
runs = pathlib.Path(sys.argv[4])
runs.write_text(runs.read_text() + sys.argv[2] + "\\n" if runs.exists() else sys.argv[2] + "\\n")
"""


@pytest.fixture
def place(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(cache))
    (tmp_path / "build.py").write_text(BUILD)
    (tmp_path / "recipe.txt").write_text("v1")
    models = tmp_path / "models"
    models.mkdir()
    return tmp_path


def build(place: Path, name: str, *inputs: Path) -> int:
    command = [sys.executable, str(place / "build.py"), str(place / "models"), name]
    command += [str(place / "recipe.txt"), str(place / "runs.txt")]
    inputs = [str(place / "build.py"), str(place / "recipe.txt"), *map(str, inputs)]
    return model_cache.main(
        ["--models", str(place / "models"), "--outputs", name, "--inputs", *inputs, "--", *command]
    )


def runs(place: Path) -> list[str]:
    path = place / "runs.txt"
    return path.read_text().split() if path.exists() else []


def test_a_second_build_of_the_same_content_is_restored_not_rerun(place):
    assert build(place, "target") == 0
    first = (place / "models" / "target" / "weights.bin").read_bytes()
    key = (place / "models" / "target" / model_cache.KEY_FILE).read_text()
    # a fresh clone: the models folder empty, the cache kept
    import shutil

    shutil.rmtree(place / "models" / "target")
    assert build(place, "target") == 0
    assert runs(place) == ["target"]
    assert (place / "models" / "target" / "weights.bin").read_bytes() == first
    assert (place / "models" / "target" / model_cache.KEY_FILE).read_text() == key


def test_a_changed_input_rebuilds_it_and_what_is_built_from_it(place):
    assert build(place, "target") == 0
    marker = place / "models" / "target" / ".batchspec-complete"
    assert build(place, "draft", marker) == 0
    assert runs(place) == ["target", "draft"]
    assert build(place, "draft", marker) == 0  # unchanged: restored
    assert runs(place) == ["target", "draft"]
    (place / "recipe.txt").write_text("v2")  # the target's input (and the draft's) changed
    assert build(place, "target") == 0
    assert build(place, "draft", marker) == 0
    assert runs(place) == ["target", "draft", "target", "draft"]
    assert (place / "models" / "target" / "weights.bin").read_bytes() == b"v2v2v2"


def test_a_model_it_starts_from_changes_its_key(place):
    assert build(place, "target") == 0
    marker = place / "models" / "target" / ".batchspec-complete"
    first = model_cache.build_key(place / "models", ["draft"], [str(marker)], ["x"])
    (place / "models" / "target" / model_cache.KEY_FILE).write_text("another\n")
    assert model_cache.build_key(place / "models", ["draft"], [str(marker)], ["x"]) != first


def test_a_damaged_entry_is_rebuilt_never_used(place):
    assert build(place, "target") == 0
    (entry,) = [p for p in (place / "cache").iterdir() if not p.name.startswith(".")]
    weights = entry / "outputs" / "target" / "weights.bin"
    weights.write_bytes(b"garbage")
    assert build(place, "target") == 0
    assert runs(place) == ["target", "target"]
    assert (place / "models" / "target" / "weights.bin").read_bytes() == b"v1v1v1"
    # and the rebuilt entry replaced the damaged one
    assert (entry / "outputs" / "target" / "weights.bin").read_bytes() == b"v1v1v1"


def test_an_entry_missing_its_manifest_is_not_an_entry(place):
    """What a build killed while storing would leave, were entries not renamed into place."""
    assert build(place, "target") == 0
    (entry,) = [p for p in (place / "cache").iterdir() if not p.name.startswith(".")]
    (entry / model_cache.MANIFEST).unlink()
    assert build(place, "target") == 0
    assert runs(place) == ["target", "target"]
    assert json.loads((entry / model_cache.MANIFEST).read_text())["outputs"] == ["target"]


def test_a_leftover_temporary_entry_is_ignored(place):
    key = model_cache.build_key(
        place / "models",
        ["target"],
        [str(place / "build.py"), str(place / "recipe.txt")],
        ["x"],
    )
    half = place / "cache" / f".tmp-target-{key}-1"
    (half / "outputs" / "target").mkdir(parents=True)
    assert build(place, "target") == 0
    assert runs(place) == ["target"]


def test_off_builds_every_time_and_writes_no_cache(place, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    assert build(place, "target") == 0
    assert build(place, "target") == 0
    assert runs(place) == ["target", "target"]
    assert not (place / "cache").exists()


def test_a_failed_build_stores_nothing(place):
    (place / "recipe.txt").write_text("fail")
    assert build(place, "target") == 3
    assert not (place / "cache").exists()
    assert not (place / "models" / "target").exists()


def test_a_builders_key_covers_the_repository_files_it_imports():
    """tools/tiny_lora.py's key follows its imports (tiny_models, model_files and through them
    batchspec.distill.recipe), and only those: the head trainer it never imports stays out of
    it, so a change to distill's heads rebuilds the head and its grown copy, not the adapters."""
    sources = {model_cache._rel(p) for p in model_cache.source_closure(ROOT / "tools" / "tiny_lora.py")}
    assert {"tools/tiny_lora.py", "tools/tiny_models.py", "tools/model_files.py"} <= sources
    assert "batchspec/distill/recipe.py" in sources
    assert "batchspec/distill/eagle3.py" not in sources
    assert "batchspec/run/job.py" not in sources  # a lazy re-export of batchspec's __init__ is not followed
    grown = {model_cache._rel(p) for p in model_cache.source_closure(ROOT / "tools" / "grow_head.py")}
    assert {"tools/grow_model.py", "batchspec/distill/eagle3.py"} <= grown
    for builder in ("grow_model", "tiny_classifier", "tiny_cross_encoder", "tiny_vlm"):
        closure = model_cache.source_closure(ROOT / "tools" / f"{builder}.py")
        assert "batchspec/distill/eagle3.py" not in {model_cache._rel(p) for p in closure}, builder


def test_a_folder_input_covers_every_file_in_it(tmp_path):
    """The head's build names the package: distill reaches its trainers through a registry of
    module names, which reading the imports does not follow."""
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (package / "trainer.py").write_text("x = 1\n")
    key = model_cache.build_key(tmp_path, ["head"], [str(tmp_path / "pkg")], ["x"])
    (package / "trainer.py").write_text("x = 2\n")
    assert model_cache.build_key(tmp_path, ["head"], [str(tmp_path / "pkg")], ["x"]) != key
