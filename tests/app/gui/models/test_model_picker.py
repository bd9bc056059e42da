"""The model picker offscreen: catalog rows (format, quant, fit estimates, releases still to come),
downloads through the row buttons against a fake Hub (a GGUF row fetches its file alone), search,
import, delete and choosing a model; screenshots of each tab."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QRect, Qt
from PySide6.QtWidgets import QInputDialog, QLabel, QMessageBox

import app.gui.models.downloads as downloads
import app.gui.models.hub_client as hub_client
import app.gui.models.model_picker as model_picker
from app.catalog import GIB, estimate_fit
from app.gui.models.downloads import DownloadManager, DownloadState
from app.gui.models.hub_search_page import SEARCH_COLUMNS
from app.gui.models.model_picker import CATALOG_COLUMNS, FIT_COLOURS, FIT_COLUMN, STATUS_COLUMN, ModelPicker
from app.model_library import ModelLibrary
from engine.resources import demo_model_dir
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.models import make_tiny_model
from tests.app.fake_hub import FakeHub, FakeRepo
from tests.screenshots import save_screenshot

GRANITE = "ibm-granite/granite-3.1-3b-a800m-instruct"
OLMOE = "allenai/OLMoE-1B-7B-0924-Instruct"
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"
DEEPSEEK = "deepseek-ai/DeepSeek-V2-Lite-Chat"
QWEN3_GGUF = "unsloth/Qwen3-30B-A3B-GGUF"
QWEN3_Q4, QWEN3_Q8 = f"{QWEN3_GGUF}:Q4_K_M", f"{QWEN3_GGUF}:Q8_0"
INSTRUCT_GGUF = "unsloth/Qwen3-30B-A3B-Instruct-2507-GGUF"
VRAM = 8 * GIB
TIMEOUT_MS = 60_000

pytestmark = pytest.mark.gui


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(root / kind, kind) for kind in ("granitemoe", "olmoe", "mixtral")}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen3_moe").read_bytes()


def gguf_repo(repo_id: str, stem: str, model: bytes) -> FakeRepo:
    """A GGUF repo as Unsloth lays it out: a file per quant (only Q4_K_M holds a model here)."""
    files = {f"{stem}-Q4_K_M.gguf": model, f"{stem}-Q8_0.gguf": b"GGUF" + bytes(2**20), "README.md": b"#"}
    return FakeRepo(repo_id, files)


@pytest.fixture
def hub(tiny_models, tiny_gguf, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # for the spawned download children
    with FakeHub() as server:
        server.add_repo(gguf_repo(QWEN3_GGUF, "Qwen3-30B-A3B", tiny_gguf))
        server.add_repo(gguf_repo(INSTRUCT_GGUF, "Qwen3-30B-A3B-Instruct-2507", tiny_gguf))
        server.add_repo(FakeRepo(GRANITE, files_of(tiny_models["granitemoe"]), model_type="granitemoe"))
        server.add_repo(FakeRepo(OLMOE, files_of(tiny_models["olmoe"]), model_type="olmoe"))
        server.add_repo(
            FakeRepo(
                MIXTRAL, files_of(tiny_models["mixtral"]), model_type="mixtral", gated=True, token="hf_tok"
            )
        )
        yield server


def make_picker(qtbot, hub, tmp_path, monkeypatch, endpoint=None) -> tuple[ModelPicker, DownloadManager]:
    monkeypatch.setattr(downloads, "load_token", lambda: None)
    monkeypatch.setattr(model_picker, "load_token", lambda: None)
    monkeypatch.setattr(hub_client, "load_token", lambda: None)
    library = ModelLibrary(tmp_path / "models")
    manager = DownloadManager(library=library, endpoint=endpoint or hub.url, poll_ms=30)
    picker = ModelPicker(manager=manager, library=library, vram_bytes=VRAM)
    qtbot.addWidget(picker)
    picker.show()
    return picker, manager


@pytest.fixture
def picker(qtbot, hub, tmp_path, monkeypatch):
    picker, manager = make_picker(qtbot, hub, tmp_path, monkeypatch)
    yield picker
    manager.shutdown()


def column(name: str) -> int:
    return CATALOG_COLUMNS.index(name)


def row_of(picker: ModelPicker, entry_id: str) -> int:
    return next(i for i, e in enumerate(picker.catalog) if e.id == entry_id)


def click(qtbot, button) -> None:
    assert button.isVisible() and button.isEnabled()
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def wait_for_status(qtbot, picker: ModelPicker, repo_id: str, text: str) -> None:
    qtbot.waitUntil(lambda: picker.status_text(repo_id).startswith(text), timeout=TIMEOUT_MS)


def test_the_catalog_shows_every_model_with_its_fit_on_this_computer(picker):
    table = picker.catalog_table
    assert table.rowCount() == len(picker.catalog) >= 23
    for row, entry in enumerate(picker.catalog):
        assert table.item(row, column("Model")).text().splitlines()[0] == entry.name
        assert table.item(row, column("Architecture")).text() == entry.architecture
        fit = estimate_fit(entry, picker.ram_bytes, VRAM)
        assert picker.fit_text(entry.id) == f"● {fit.summary}"
        assert FIT_COLOURS[fit.level] in table.cellWidget(row, FIT_COLUMN).findChild(QLabel).styleSheet()
        if not entry.bundled and not entry.coming:
            assert picker.status_text(entry.source.key) == "Not downloaded"
            assert picker.row_buttons(entry.source.key) == ["Download"]
    qwen = table.item(row_of(picker, "qwen3-30b-a3b"), column("Parameters")).text()
    assert qwen == "30.5B total\n3.3B active"
    formats = {e.id: table.item(row_of(picker, e.id), column("Format")).text() for e in picker.catalog}
    assert formats["qwen3-30b-a3b-gguf-q4_k_m"] == "GGUF\nQ4_K_M"
    assert formats["qwen3-30b-a3b-gguf-q8_0"] == "GGUF\nQ8_0"
    assert formats["qwen3-30b-a3b"] == "BF16\nsafetensors"
    assert formats["gpt-oss-20b"] == "MXFP4\nsafetensors"
    assert formats["qwen3-30b-a3b-instruct-2507-fp8"] == "FP8\nsafetensors"
    assert table.item(row_of(picker, "qwen3-30b-a3b-gguf-q4_k_m"), column("Download")).text() == "~17.3 GiB"
    mixtral = row_of(picker, "mixtral-8x7b-instruct-v0.1")
    assert table.item(mixtral, column("Licence")).text() == "Apache-2.0\ngated"
    assert "GPU 8.0 GiB" in picker.machine_label.text()

    picker.set_vram_bytes(None)
    olmoe = picker.catalog[row_of(picker, "olmoe-1b-7b-0924-instruct")]
    assert (
        picker.fit_text("olmoe-1b-7b-0924-instruct")
        == f"● {estimate_fit(olmoe, picker.ram_bytes, None).summary}"
    )
    assert "no GPU found" in picker.machine_label.text()


def test_a_coming_release_says_why_and_offers_no_download(qtbot, hub, tmp_path, monkeypatch, request):
    entry_id = "qwen3-30b-a3b-instruct-2507-fp8"  # as if its format could not be loaded yet
    why = "MoE Chat cannot load FP8 weights yet: take GGUF Q8_0 or BF16"
    real = model_picker.load_catalog()
    monkeypatch.setattr(
        model_picker,
        "load_catalog",
        lambda: tuple(
            replace(e, status="coming", status_reason=why) if e.id == entry_id else e for e in real
        ),
    )
    picker, manager = make_picker(qtbot, hub, tmp_path, monkeypatch)
    request.addfinalizer(manager.shutdown)
    row = row_of(picker, entry_id)
    assert picker.catalog_status_text(entry_id).startswith("Coming: MoE Chat cannot load FP8 weights yet")
    status = picker.catalog_table.cellWidget(row, STATUS_COLUMN).findChild(QLabel)
    assert status.toolTip() == picker.catalog[row].notes
    assert picker.catalog_table.cellWidget(row, STATUS_COLUMN + 1) is None  # no buttons at all
    with pytest.raises(KeyError):
        picker.download_row(picker.catalog[row].source.key)
    picker.catalog_table.selectRow(row)
    assert picker.selected_model_path() is None and not picker.use_button.isEnabled()
    assert not [path for _, path, _ in hub.requests if "FP8" in path]
    assert picker.row_buttons("openai/gpt-oss-20b") == ["Download"]  # MXFP4 loads: offered as shipped


@pytest.mark.slow
def test_a_gguf_row_downloads_its_quant_alone_and_can_be_used(qtbot, picker, hub):
    row = row_of(picker, "qwen3-30b-a3b-gguf-q4_k_m")
    click(qtbot, picker.download_row(QWEN3_Q4).download_button)
    wait_for_status(qtbot, picker, QWEN3_Q4, "Installed ✓")
    assert [p.rsplit("/", 1)[1] for p in hub.file_gets(QWEN3_GGUF)] == ["Qwen3-30B-A3B-Q4_K_M.gguf"]
    assert picker.status_text(QWEN3_Q8) == "Not downloaded"  # the other quant of the same repo
    folder = picker.library.folder_for(QWEN3_Q4)
    assert [p.name for p in folder.iterdir() if p.is_file()] == ["Qwen3-30B-A3B-Q4_K_M.gguf"]
    picker.catalog_table.selectRow(row)
    with qtbot.waitSignal(picker.sig_model_chosen) as chosen:
        click(qtbot, picker.use_button)
    assert chosen.args == [str(folder)]  # the engine's --model finds the one GGUF in it


def test_the_demo_can_be_chosen_at_once(qtbot, picker):
    picker.catalog_table.selectRow(row_of(picker, "demo"))
    with qtbot.waitSignal(picker.sig_model_chosen) as chosen:
        click(qtbot, picker.use_button)
    assert chosen.args == [str(demo_model_dir())]


@pytest.mark.slow
def test_download_through_the_row_then_use_then_delete(qtbot, picker, monkeypatch):
    row = row_of(picker, "granite-3.1-3b-a800m-instruct")
    picker.catalog_table.selectRow(row)
    assert not picker.use_button.isEnabled()
    click(qtbot, picker.download_row(GRANITE).download_button)
    wait_for_status(qtbot, picker, GRANITE, "Installed ✓")
    assert picker.row_buttons(GRANITE) == ["Delete"]
    assert picker.use_button.isEnabled()
    folder = str(picker.library.folder_for(GRANITE))
    assert folder in [
        picker.local_page.table.item(r, 3).text() for r in range(picker.local_page.table.rowCount())
    ]
    with qtbot.waitSignal(picker.sig_model_chosen) as chosen:
        click(qtbot, picker.use_button)
    assert chosen.args == [folder]
    assert not picker.isVisible()  # choosing closes the dialog

    picker.show()
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    click(qtbot, picker.download_row(GRANITE).delete_button)
    assert picker.status_text(GRANITE) == "Not downloaded" and not Path(folder).exists()


@pytest.mark.slow
def test_a_failed_download_shows_why_and_retry_from_the_row_works(qtbot, picker, monkeypatch):
    real_disk_free_bytes = downloads.disk_free_bytes
    monkeypatch.setattr(downloads, "disk_free_bytes", lambda path: 10 * 2**20)
    click(qtbot, picker.download_row(OLMOE).download_button)
    wait_for_status(qtbot, picker, OLMOE, "Failed: Not enough disk space: ")
    assert ", 10.0 MiB free on " in picker.status_text(OLMOE)
    assert picker.row_buttons(OLMOE) == ["Retry"]
    reason = picker.status_text(OLMOE).removeprefix("Failed: ")
    assert picker.error_text() == f"{OLMOE} was not downloaded. {reason}"  # in full, under the table
    assert picker.error_panel.details_button.isVisible()

    monkeypatch.setattr(downloads, "disk_free_bytes", real_disk_free_bytes)
    click(qtbot, picker.download_row(OLMOE).retry_button)
    wait_for_status(qtbot, picker, OLMOE, "Installed ✓")
    assert picker.error_text() == ""  # the retry cleared it


@pytest.mark.slow
def test_cancel_from_the_row(qtbot, picker, hub):
    hub.faults.bytes_per_s = 50_000
    click(qtbot, picker.download_row(OLMOE).download_button)
    qtbot.waitUntil(
        lambda: picker.manager.state(OLMOE).state is DownloadState.DOWNLOADING, timeout=TIMEOUT_MS
    )
    assert picker.status_text(OLMOE).startswith("Downloading ")
    assert picker.row_buttons(OLMOE) == ["Cancel"]
    click(qtbot, picker.download_row(OLMOE).cancel_button)
    assert picker.status_text(OLMOE) == "Cancelled" and picker.row_buttons(OLMOE) == ["Retry"]
    assert not picker.library.folder_for(OLMOE).exists()


@pytest.mark.slow
def test_a_gated_model_asks_for_a_token_first(qtbot, picker, monkeypatch):
    stored = []
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("hf_tok", True))
    monkeypatch.setattr(
        model_picker, "store_token", lambda token: stored.append(token) or "the system keyring"
    )
    monkeypatch.setattr(downloads, "load_token", lambda: stored[-1] if stored else None)
    click(qtbot, picker.download_row(MIXTRAL).download_button)
    wait_for_status(qtbot, picker, MIXTRAL, "Installed ✓")
    assert stored == ["hf_tok"]
    assert picker.message_label.text() == "Token saved in the system keyring."


@pytest.mark.slow
def test_search_lists_supported_models_and_downloads_from_a_result(qtbot, picker, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest imported it offline
    hub.add_repo(FakeRepo("someone/dense-llama", {}, model_type="llama", downloads=10**6))
    quantized = {"quantization_config": {"quant_method": "bitsandbytes"}}
    hub.add_repo(FakeRepo("someone/moe-gptq", {}, model_type="mixtral", downloads=5, config=quantized))
    w4a16 = {  # RedHatAI's w4a16 releases: compressed-tensors pack-quantized, which MoE Chat reads
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 128,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    }
    ct = FakeRepo(
        "someone/moe-w4a16",
        {},
        model_type="qwen3_moe",
        downloads=6,
        config=w4a16,
        tags=("compressed-tensors",),
    )
    hub.add_repo(ct)
    picker.tabs.setCurrentIndex(1)
    picker.search_box.setText("e")
    picker.search()
    qtbot.waitUntil(lambda: picker.search_table.rowCount() > 0, timeout=TIMEOUT_MS)
    table = picker.search_table
    names = [table.item(r, 0).text() for r in range(table.rowCount())]
    assert "someone/dense-llama" not in names and GRANITE in names
    assert picker.search_status.text().endswith("of supported architectures found.")
    quantized_row = names.index("someone/moe-gptq")
    assert table.item(quantized_row, SEARCH_COLUMNS.index("Notes")).text() == "pre-quantized: cannot run"
    assert not picker.download_row("someone/moe-gptq", "search").download_button.isEnabled()
    assert picker.download_row("someone/moe-w4a16", "search").download_button.isEnabled()  # it loads
    row = names.index(OLMOE)
    assert table.item(row, SEARCH_COLUMNS.index("Architecture")).text() == "olmoe"
    click(qtbot, picker.download_row(OLMOE, "search").download_button)
    wait_for_status(qtbot, picker, OLMOE, "Installed ✓")
    table.selectRow(row)
    assert picker.selected_model_path() == str(picker.library.folder_for(OLMOE))
    save_screenshot(picker, "model_picker_search.png", tmp_path)


@pytest.mark.slow
def test_a_local_folder_is_imported_and_can_be_chosen(qtbot, picker, tiny_models, tmp_path):
    picker.tabs.setCurrentIndex(2)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    picker.local_page.import_model(str(bad))
    qtbot.waitUntil(lambda: picker.message_label.text().startswith("Cannot import:"), timeout=TIMEOUT_MS)
    assert "has no config.json" in picker.message_label.text()

    picker.local_page.import_model(str(tiny_models["olmoe"]))
    qtbot.waitUntil(lambda: picker.message_label.text() == "Imported olmoe.", timeout=TIMEOUT_MS)
    table = picker.local_page.table
    assert [table.item(r, 1).text() for r in range(table.rowCount())] == ["bundled", "imported"]
    table.selectRow(1)
    with qtbot.waitSignal(picker.sig_model_chosen) as chosen:
        click(qtbot, picker.use_button)
    assert chosen.args == [str(tiny_models["olmoe"])]
    save_screenshot(picker, "model_picker_local.png", tmp_path)


@pytest.mark.slow
def test_screenshot_of_the_catalog_with_an_installed_a_downloading_and_a_failed_model(
    qtbot, picker, hub, tmp_path, monkeypatch
):
    click(qtbot, picker.download_row(QWEN3_Q4).download_button)
    wait_for_status(qtbot, picker, QWEN3_Q4, "Installed ✓")
    click(qtbot, picker.download_row("Qwen/Qwen3-30B-A3B").download_button)  # not on this Hub
    wait_for_status(qtbot, picker, "Qwen/Qwen3-30B-A3B", "Failed: ")
    click(qtbot, picker.download_row(GRANITE).download_button)
    wait_for_status(qtbot, picker, GRANITE, "Installed ✓")
    hub.faults.bytes_per_s = 20_000
    instruct_q4 = f"{INSTRUCT_GGUF}:Q4_K_M"
    click(qtbot, picker.download_row(instruct_q4).download_button)
    qtbot.waitUntil(
        lambda: picker.manager.state(instruct_q4).state is DownloadState.DOWNLOADING, timeout=TIMEOUT_MS
    )
    picker.catalog_table.selectRow(row_of(picker, "qwen3-30b-a3b-gguf-q4_k_m"))
    path = save_screenshot(picker, "model_picker.png", tmp_path)
    assert path.stat().st_size > 10_000
    picker.catalog_table.selectRow(row_of(picker, "granite-3.1-3b-a800m-instruct"))
    picker.catalog_table.scrollToBottom()
    assert save_screenshot(picker, "model_picker_bottom.png", tmp_path).stat().st_size > 10_000


OFFLINE = (
    "This computer seems to be offline (the Hub at no-such-hub.invalid cannot be reached): "
    "check the internet connection, then try again."
)


def as_screen(monkeypatch, width: int, height: int) -> QRect:
    available = QRect(0, 0, width, height)
    monkeypatch.setattr(model_picker, "available_geometry", lambda widget: available)
    return available


def assert_in_view(widget, dialog) -> None:
    """Shown, inside the dialog, and not clipped by a scrolled table or a narrow column."""
    assert widget.isVisible()
    visible = widget.visibleRegion().boundingRect()
    assert visible == widget.rect(), f"{widget}: {visible} of {widget.rect()}"
    assert dialog.rect().contains(QRect(widget.mapTo(dialog, widget.rect().topLeft()), widget.size()))


@pytest.mark.slow
def test_on_a_1024x600_screen_the_dialog_fits_and_offline_is_said_in_full(
    qtbot, hub, tmp_path, monkeypatch, capfd
):
    available = as_screen(monkeypatch, 1024, 600)
    picker, manager = make_picker(qtbot, hub, tmp_path, monkeypatch, endpoint="http://no-such-hub.invalid")
    try:
        qtbot.waitExposed(picker)
        assert picker.width() <= available.width() and picker.height() <= available.height()
        for entry in picker.catalog[:5]:
            if not entry.bundled and not entry.coming:
                assert_in_view(picker.download_row(entry.source.key).download_button, picker)
        assert_in_view(picker.use_button, picker)
        save_screenshot(picker, "model_picker_1024x600.png", tmp_path)

        click(qtbot, picker.download_row(OLMOE).download_button)
        wait_for_status(qtbot, picker, OLMOE, "Failed: ")
        assert picker.status_text(OLMOE) == f"Failed: {OFFLINE}"
        assert picker.error_text() == f"{OLMOE} was not downloaded. {OFFLINE}"
        label = picker.error_panel.message_label
        assert_in_view(label, picker)
        assert label.height() >= label.heightForWidth(label.width())  # wrapped, not cut
        save_screenshot(picker, "model_picker_offline_1024x600.png", tmp_path)
        click(qtbot, picker.error_panel.details_button)
        assert "gaierror" in picker.error_panel.details_view.toPlainText()
        save_screenshot(picker, "model_picker_offline_details_1024x600.png", tmp_path)

        picker.tabs.setCurrentIndex(1)
        picker.search_box.setText("qwen")
        picker.search()
        qtbot.waitUntil(lambda: picker.search_status.text().startswith("The search failed"), timeout=5000)
        assert picker.error_text() == OFFLINE and not picker.error_panel.details_view.isVisible()
        save_screenshot(picker, "model_picker_search_offline_1024x600.png", tmp_path)
    finally:
        manager.shutdown()
    assert capfd.readouterr().err == ""
