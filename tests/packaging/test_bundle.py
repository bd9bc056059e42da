"""Build the PyInstaller bundle (packaging/build.py) and run the frozen app: ~5 min on 2 cores.

The first test's output (`pytest -s`) gives the build time and the folder's size.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers.models.auto.configuration_auto import model_type_to_module_name

from engine.model.adapters import SUPPORTED_MODEL_TYPES
from tests.screenshots import screenshot_path

pytest.importorskip("PyInstaller", reason="the bundle needs PyInstaller: pip install -e '.[dev]'")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "packaging" / "build.py"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> dict:
    """Build once for the module: build.py's JSON report (time, size, executable, self-test)."""
    folder = tmp_path_factory.mktemp("bundle")
    report = folder / "build.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BUILD_SCRIPT),
            "--dist",
            str(folder / "dist"),
            "--work",
            str(folder / "work"),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert report.is_file(), f"no report; status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    result = json.loads(report.read_text())
    result["build_output"] = done.stdout
    return result


def frozen_modules(executable: Path) -> set[str]:
    from PyInstaller.archive.readers import CArchiveReader

    return set(CArchiveReader(str(executable)).open_embedded_archive("PYZ.pyz").toc)


def test_the_bundle_builds_and_its_self_test_passes(bundle):
    print(f"\nbuild: {bundle['seconds'] / 60:.1f} min, {bundle['bytes'] / 2**20:.0f} MiB, {bundle['torch']}")
    print(bundle["self_test"]["line"])
    assert bundle["self_test"]["status"] == 0, bundle["build_output"]
    assert bundle["self_test"]["line"].startswith("self-test passed: worker ")
    assert "'A cow says moo.'" in bundle["self_test"]["line"]


def test_the_bundle_holds_resources_and_every_architecture_but_no_development_files(bundle):
    executable = Path(bundle["executable"])
    internal = executable.parent / "_internal"
    resources = internal / "resources"
    for model in ("target", "draft"):
        assert (resources / "demo-moe" / model / "model.safetensors").is_file()
        assert (resources / "demo-moe" / model / "tokenizer.json").is_file()
    assert (resources / "catalog.json").is_file() and (resources / "moe-chat.desktop").is_file()
    assert (resources / "icons" / "moe-chat-256.png").is_file()
    assert not list(resources.rglob("*.py")), "the demo's training scripts stay out"
    modules = frozen_modules(executable)
    for model_type in SUPPORTED_MODEL_TYPES:
        module = model_type_to_module_name(model_type)  # inkling_text lives in models.inkling
        modeling = f"transformers.models.{module}.modeling_{module}"
        if importlib.util.find_spec(modeling) is not None:  # sarvam_mla has none: it reuses another's
            assert modeling in modules
    assert "engine.model.adapters.generic" in modules  # the one adapter every family goes through
    assert "engine.worker.loop" in modules and "app.download_child" in modules
    # remote engines: the OpenAI client and the Prometheus parser are the app's own now
    assert {"engine.remote.worker", "openai", "prometheus_client.parser"} <= modules
    development = {"tests", "pytest", "_pytest", "pytestqt", "ruff"}
    assert not {module for module in modules if module.split(".")[0] in development}
    # llama.cpp's CPU kernels, where engine.ggml.library looks for them
    assert "libggml" in modules and list((internal / "libggml").rglob("*ggml-cpu*"))
    # transformers reads its own source at run time: the .py files ride along
    assert list((internal / "transformers").rglob("modeling_utils.py"))


def test_the_frozen_terminal_chat_answers(bundle):
    done = subprocess.run(
        [bundle["executable"], "cli", "--device", "cpu", "--greedy"],
        input="What sound does a cow make?\n/quit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("A cow says moo.\n")


@pytest.mark.gui
def test_the_frozen_window_starts_offscreen_and_its_worker_answers(bundle, tmp_path):
    shot = screenshot_path("frozen_window.png", tmp_path)
    shot.unlink(missing_ok=True)
    done = subprocess.run(
        [bundle["executable"], "--self-test", "--window", "--device", "cpu", "--screenshot", str(shot)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen", "MOE_CHAT_DATA_DIR": str(tmp_path / "data")},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().startswith("self-test passed: the window's engine answered 'A cow says moo.'")
    assert shot.stat().st_size > 10_000
    assert not (tmp_path / "data").exists()


def _spawned_children(process) -> dict[int, str]:
    """Each running child that multiprocessing started, by pid, with the executable it runs.

    Other children come and go while the app starts (ctypes looking up a library runs the linker),
    and a child that ends between being listed and being read is left out.
    """
    import psutil

    spawned = {}
    for child in process.children(recursive=True):
        try:
            if any("multiprocessing" in part for part in child.cmdline()):
                spawned[child.pid] = child.exe()
        except psutil.NoSuchProcess:
            continue
    return spawned


@pytest.mark.gui
def test_the_frozen_app_opens_normally_with_its_worker_beside_it(bundle, tmp_path):
    import psutil

    env = {
        **os.environ,
        "QT_QPA_PLATFORM": "offscreen",
        "MOE_CHAT_DATA_DIR": str(tmp_path / "data"),
        "MOE_CHAT_CONFIG_DIR": str(tmp_path / "config"),
    }
    executable = Path(bundle["executable"]).resolve()
    log = tmp_path / "app.log"
    with log.open("wb") as output:
        app = subprocess.Popen([str(executable)], env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        workers = {}
        while time.monotonic() < deadline and app.poll() is None and not workers:
            workers = _spawned_children(psutil.Process(app.pid))
            time.sleep(0.5)
        assert app.poll() is None, log.read_text(errors="replace")[-3000:]
        # the engine worker is this same executable, started again by multiprocessing's spawn
        assert workers and set(workers.values()) == {str(executable)}, workers
        assert (tmp_path / "data").is_dir()  # the window opened its conversation store
    finally:
        app.terminate()
        app.wait(30)
