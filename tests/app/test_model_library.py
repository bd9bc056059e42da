"""The model library: the demo, downloads in and out of progress (whole repos and single GGUF
quants), and imported folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.model_library import (
    PARTIAL_MARKER,
    InstalledModel,
    ModelImportError,
    ModelLibrary,
    ModelSource,
    check_folder,
    folder_name,
    key_of_folder,
)
from engine.resources import demo_model_dir
from engine.tiny.models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "my-moe", "olmoe")


def test_the_demo_is_always_listed_and_never_deletable(tmp_path):
    library = ModelLibrary(tmp_path / "models")
    [demo] = library.list_installed()
    assert (demo.source, demo.path, demo.deletable) == ("bundled", str(demo_model_dir()), False)
    with pytest.raises(ValueError, match="cannot be deleted"):
        library.delete(demo)
    assert demo_model_dir().is_dir()


def test_the_default_root_is_under_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path))
    library = ModelLibrary()
    assert library.folder_for("Qwen/Qwen3-30B-A3B") == tmp_path / "models" / "Qwen--Qwen3-30B-A3B"


@pytest.mark.parametrize("bad", ["noslash", "a/b/c", "../x", "a/..", "/name", "a--b/c", "a/b:Q4/x"])
def test_folder_names_come_only_from_org_slash_name(bad):
    with pytest.raises(ValueError, match=r"not an 'org/name' Hub id|not a quant name"):
        folder_name(bad)


def test_each_quant_of_a_gguf_repo_has_its_own_folder_named_back_to_its_key():
    q4 = ModelSource("unsloth/Qwen3-30B-A3B-GGUF", ("Qwen3-30B-A3B-Q4_K_M.gguf",), "Q4_K_M")
    assert q4.key == "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"
    assert folder_name(q4.key) == "unsloth--Qwen3-30B-A3B-GGUF--Q4_K_M"
    assert ModelSource("Qwen/Qwen3-30B-A3B").key == "Qwen/Qwen3-30B-A3B"
    for key in (q4.key, "Qwen/Qwen3-30B-A3B", "o/m:UD-Q4_K_XL"):
        assert key_of_folder(folder_name(key)) == key
    assert key_of_folder("not-a-download") is None
    with pytest.raises(ValueError, match="need a quant name"):
        ModelSource("o/m-GGUF", ("m.gguf",))


def test_a_gguf_download_is_listed_by_its_folder_or_by_its_file_in_a_subfolder(tmp_path):
    library = ModelLibrary(tmp_path / "models")
    folder = library.begin_download("o/m-GGUF:Q4_K_M")
    (folder / "m-Q4_K_M.gguf").write_bytes(b"GGUF" * 100)
    assert library.has_partial("o/m-GGUF:Q4_K_M") and not library.is_installed("o/m-GGUF:Q4_K_M")
    library.finish_download("o/m-GGUF:Q4_K_M")
    assert library.installed_path("o/m-GGUF:Q4_K_M") == folder  # the engine finds the one GGUF in it
    assert not library.is_installed("o/m-GGUF:Q8_0")  # another quant of the same repo

    nested = library.begin_download("o/big-GGUF:Q8_0")
    (nested / "Q8_0").mkdir()
    for part in (2, 1):
        (nested / "Q8_0" / f"big-Q8_0-0000{part}-of-00002.gguf").write_bytes(b"GGUF")
    library.finish_download("o/big-GGUF:Q8_0")
    first_part = nested / "Q8_0" / "big-Q8_0-00001-of-00002.gguf"
    assert library.installed_path("o/big-GGUF:Q8_0") == first_part
    models = {m.repo_id: m for m in library.list_installed() if m.source == "downloaded"}
    assert models["o/m-GGUF:Q4_K_M"] == InstalledModel(
        "o/m-GGUF:Q4_K_M", str(folder), "downloaded", "o/m-GGUF:Q4_K_M", 400
    )
    assert models["o/big-GGUF:Q8_0"].path == str(first_part)
    library.delete(models["o/big-GGUF:Q8_0"])  # the whole download's folder, not just the file
    assert not nested.exists() and folder.is_dir()


def test_a_download_is_listed_only_once_finished_and_delete_removes_it(tmp_path):
    library = ModelLibrary(tmp_path / "models")
    folder = library.begin_download("org/model")
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    assert library.has_partial("org/model") and not library.is_installed("org/model")
    assert [m.source for m in library.list_installed()] == ["bundled"]

    library.finish_download("org/model")
    model = library.find("org/model")
    assert model == InstalledModel("org/model", str(folder), "downloaded", "org/model", 1002)
    library.discard_download("org/model")  # never touches a finished model
    assert folder.is_dir()
    library.delete(model)
    assert not folder.exists() and library.find("org/model") is None


def test_discarding_removes_only_an_unfinished_download(tmp_path):
    library = ModelLibrary(tmp_path / "models")
    folder = library.begin_download("org/partial")
    (folder / ".cache" / "huggingface" / "download").mkdir(parents=True)
    incomplete = folder / ".cache" / "huggingface" / "download" / "abc.incomplete"
    incomplete.write_bytes(b"half")
    library.remove_incomplete_files("org/partial")
    assert not incomplete.exists() and (folder / PARTIAL_MARKER).exists()
    neighbour = library.begin_download("org/other")
    library.discard_download("org/partial")
    assert not folder.exists() and neighbour.is_dir()


def test_a_folder_outside_the_library_is_never_deleted(tmp_path):
    library = ModelLibrary(tmp_path / "models")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(ValueError, match="not in the model library"):
        library.delete(InstalledModel("x", str(outside), "downloaded", "x/y"))
    assert outside.is_dir()


@pytest.mark.slow
def test_an_imported_folder_is_checked_registered_by_reference_and_forgotten(tmp_path, tiny_model):
    library = ModelLibrary(tmp_path / "models")
    model = library.import_model(tiny_model)
    assert (model.name, model.path, model.source) == ("my-moe", str(tiny_model), "imported")
    assert library.import_model(tiny_model) == model  # not listed twice
    assert [m.path for m in library.list_installed()] == [str(demo_model_dir()), str(tiny_model)]
    assert ModelLibrary(tmp_path / "models").list_installed()[1] == model  # kept on disk

    library.delete(model)
    assert tiny_model.is_dir() and (tiny_model / "model.safetensors").is_file()
    assert len(library.list_installed()) == 1


def test_an_imported_folder_that_disappeared_is_listed_as_missing(tmp_path, tiny_model):
    copy = tmp_path / "copy"
    copy.mkdir()
    library = ModelLibrary(tmp_path / "models", checker=lambda path: _ok_check(path))
    library.import_model(copy)
    copy.rmdir()
    assert library.list_installed()[1].missing


def _ok_check(path):
    from engine.model.check import ModelCheck

    return ModelCheck(str(path), ())


@pytest.mark.slow
def test_a_folder_the_engine_cannot_load_is_refused_with_the_reasons(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    library = ModelLibrary(tmp_path / "models")
    with pytest.raises(ModelImportError) as caught:
        library.import_model(broken)
    reasons = str(caught.value).splitlines()
    assert reasons[0].startswith("Architecture 'llama' is not supported.")
    assert any("has no tokenizer" in r for r in reasons) and any("No *.safetensors" in r for r in reasons)
    assert len(library.list_installed()) == 1


@pytest.mark.slow
def test_the_folder_check_runs_in_a_child_so_this_process_never_loads_safetensors(tiny_model):
    code = (
        "import sys; from app.model_library import check_folder; "
        f"check = check_folder({str(tiny_model)!r}); "
        "print(check.ok, 'safetensors' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "False", "False"]
    assert check_folder(tiny_model).model_type == "olmoe"


@pytest.fixture(scope="module")
def two_ggufs(tmp_path_factory) -> tuple[Path, Path]:
    from gguf import GGMLQuantizationType as QT

    from engine.tiny.gguf_writer import write_tiny_gguf

    folder = tmp_path_factory.mktemp("ggufs")
    return write_tiny_gguf(folder, expert_type=QT.Q4_K), write_tiny_gguf(folder, expert_type=QT.Q8_0)


def test_a_gguf_file_is_imported_by_itself_under_the_name_it_gives_itself(tmp_path, two_ggufs):
    from engine.model.check import check_model_folder

    library = ModelLibrary(tmp_path / "models", checker=check_model_folder)
    model = library.import_model(two_ggufs[0])
    assert (model.name, model.path, model.source) == (
        "tiny-qwen3_moe-Q4_K (Q4_K_M)",
        str(two_ggufs[0]),
        "imported",
    )
    assert model.size_bytes == two_ggufs[0].stat().st_size
    assert library.list_installed()[1] == model and library.name_of(two_ggufs[0]) == model.name


def test_a_folder_of_several_gguf_models_names_them_to_choose_from(tmp_path, two_ggufs):
    from engine.model.check import check_model_folder

    library = ModelLibrary(tmp_path / "models", checker=check_model_folder)
    with pytest.raises(ModelImportError, match="holds several GGUF models") as caught:
        library.import_model(two_ggufs[0].parent)
    assert caught.value.choices == two_ggufs
    assert library.import_model(caught.value.choices[1]).name == "tiny-qwen3_moe-Q8_0"  # named already


def test_a_split_sets_first_part_is_the_model_its_parts_summed(tmp_path, two_ggufs):
    from engine.model.check import check_model_folder
    from engine.tiny.gguf_writer import write_split_gguf

    source = tmp_path / "split" / "big.gguf"
    source.parent.mkdir()
    source.write_bytes(two_ggufs[0].read_bytes())
    parts = write_split_gguf(source, 2)
    source.unlink()
    library = ModelLibrary(tmp_path / "models", checker=check_model_folder)
    model = library.import_model(parts[0])
    assert model.size_bytes == sum(part.stat().st_size for part in parts)
    assert "00001" not in model.name
